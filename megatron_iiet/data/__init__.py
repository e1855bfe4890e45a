"""Data pipeline: tokenizer training and wrapping, streaming sharded preprocessing into
megatron-core indexed datasets, the built-in default corpus, and blend validation.

Modules are imported lazily by their users: `import megatron_iiet.data` must stay cheap because
the preprocessing workers and the CLIs start many short-lived processes.
"""

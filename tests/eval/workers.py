"""What the spawned evaluation ranks run: the native backend at several layouts on one fixed
set of requests, at batch sizes 1 and 8."""

from lm_eval.api.instance import Instance

CODE = ["def main(argv=None):\n    parser = argparse.ArgumentParser()\n    return 0\n",
        "import os\nimport sys\n\n\nclass Reader(object):\n    def __init__(self, path):\n",
        "    for key, value in sorted(items.items()):\n        if value is None:\n            continue\n",
        "x = 1", "raise ValueError('bad value: %r' % (value,))"]
LONG = "\n".join(CODE) * 4  # longer than the model's 64 tokens: truncated / several windows


def requests():
    """(loglikelihood, loglikelihood_rolling, generate_until) Instances covering an empty
    context, one- and many-token continuations, left truncation, several rolling windows,
    several continuations of one context."""
    ll = [("", "import os"), (LONG, "\n    return None"), ("def f(", "x):"),
          ("class A", "(object):\n    pass"), ("y = ", "2"), ("for i in ", "range(10):")]
    ll += [(t[: len(t) // 2], t[len(t) // 2:]) for t in CODE]
    # choices of one question: the torch runner scores them on one pass over the context
    ll += [("Question: which?\nAnswer:", ending) for ending in (" yes", " no", " both of them\n")]
    ll += [("def f(", "self, y):"), (LONG, "\n    return x")]
    rolling = CODE[:3] + [LONG]
    gen = [("def main(", {"until": ["\n\n"], "max_gen_toks": 12}),
           ("import ", {"until": ["\n"], "max_gen_toks": 8}),
           (LONG, {"until": [")"], "max_gen_toks": 10}),
           ("class ", {"until": [":"], "max_gen_toks": 6})]
    return ([Instance("loglikelihood", {}, a, i) for i, a in enumerate(ll)],
            [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(rolling)],
            [Instance("generate_until", {}, a, i) for i, a in enumerate(gen)])


def run_all(lm) -> dict:
    ll, rolling, gen = requests()
    out = {}
    for batch_size in (1, 8):
        lm.scorer.batch_size = batch_size
        out[batch_size] = {"loglikelihood": lm.loglikelihood(ll),
                           "rolling": lm.loglikelihood_rolling(rolling),
                           "generate": lm.generate_until(gen)}
    return out


def score_at_layouts(checkpoint: str, layouts: list, own_loss_text: str = "") -> dict:
    """{"tp,pp": run_all results} on rank 0 (None elsewhere), each layout in turn; with
    ``own_loss_text``, also "own_loss" (see ``own_token_loss``) at the first layout."""
    from megatron.core import parallel_state as ps

    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.eval.native_lm import IIETMegatronLM

    results = {}
    for tp, pp in layouts:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp)
        seed_everything(1234)
        lm = IIETMegatronLM(checkpoint=checkpoint, tensor_parallel=tp, pipeline_parallel=pp,
                            progress=False)
        results[f"{tp},{pp}"] = lm.scorer.drive(lambda: run_all(lm))
        if own_loss_text and "own_loss" not in results:
            results["own_loss"] = own_token_loss(lm, own_loss_text)
    return results


def own_token_loss(lm, text: str) -> dict:
    """The megatron model's summed next-token loss on [prefix] + text (one window), next to
    the backend's loglikelihood_rolling of the text (every rank of a PP=1 layout calls it)."""
    import torch

    tokens = [lm.prefix_token_id] + lm.tok_encode(text)
    assert len(tokens) <= lm.max_length + 1
    ids = torch.tensor([tokens[:-1]])
    labels = torch.tensor([tokens[1:]])
    with torch.no_grad():
        per_token = lm.scorer.model(ids, labels=labels)
    rolling = lm.scorer.drive(
        lambda: lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)]))
    return {"loss_sum": float(per_token.double().sum()),
            "rolling": rolling[0] if rolling else None, "tokens": len(tokens) - 1}

"""A callback as a user would write one outside the library, named in a run's config
(test_callbacks.py::test_a_callback_named_in_the_config_runs)."""

from megatron_iiet.training.callbacks import Callback


class TokensSeen(Callback):
    def __init__(self, tokens_per_sample: int):
        self.tokens_per_sample = tokens_per_sample

    def on_step_end(self, trainer, event):
        trainer.reporter.event("tokens_seen", event.step,
                               tokens=trainer.state.consumed_samples * self.tokens_per_sample)


class GradNormSeen(Callback):
    """The gradient norm a callback sees before the optimizer step (to compare with the
    pre-clipping norm the step reports)."""

    def on_before_optimizer_step(self, trainer):
        import torch

        grads = trainer.engine.gradients()
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
        trainer.reporter.event("grad_norm_seen", trainer.state.step + 1, norm=norm)

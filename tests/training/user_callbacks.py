"""A callback as a user would write one outside the library, named in a run's config
(test_callbacks.py::test_a_callback_named_in_the_config_runs)."""

from megatron_iiet.training.callbacks import Callback


class TokensSeen(Callback):
    def __init__(self, tokens_per_sample: int):
        self.tokens_per_sample = tokens_per_sample

    def on_step_end(self, trainer, event):
        trainer.reporter.event("tokens_seen", event.step,
                               tokens=trainer.state.consumed_samples * self.tokens_per_sample)

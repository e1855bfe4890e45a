"""megatron_iiet: pretraining IIET, E-IIET and their baselines on megatron-core."""

__version__ = "0.1.0"

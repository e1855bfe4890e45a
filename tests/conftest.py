import os
import warnings

# megatron-core warns at import about every optional CUDA extension it does not find.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
os.environ.setdefault("OMP_NUM_THREADS", "2")

"""memplan: predict GPU memory for training and serving Hugging Face models, and plan configs.

    import memplan
    est = memplan.estimate("bert-large", "v100-16g", micro_batch=4, seq_len=512, precision="fp32")
    est.device_used_bytes, est.fits
    best = memplan.suggest("bert-large", "v100-16g").plans[0]
"""

__version__ = "0.1.0"

from memplan.api import estimate, suggest, workload  # noqa: E402
from memplan.inputs.catalog import list_models, resolve_model  # noqa: E402
from memplan.errors import UserError  # noqa: E402
from memplan.estimator.breakdown import MemoryBreakdown  # noqa: E402
from memplan.inputs.modelspec import ModelSpec, ParamGroup  # noqa: E402
from memplan.inputs.profiles import GPUProfile, list_gpus, load_gpu  # noqa: E402
from memplan.search.plan import Plan, Suggestion  # noqa: E402
from memplan.inputs.workload import Workload  # noqa: E402

__all__ = ["estimate", "suggest", "workload", "list_models", "resolve_model", "UserError", "MemoryBreakdown",
           "ModelSpec", "ParamGroup", "GPUProfile", "list_gpus", "load_gpu", "Plan", "Suggestion", "Workload",
           "__version__"]

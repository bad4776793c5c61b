"""The policy compiler: validated objects -> MeshModel, in passes (pipeline.py runs them).

    resolve -> security -> fallback -> qos -> functions -> rollouts -> gateways -> shedding
    -> sidecars -> assemble

One module per pass. Each pass takes the stage the pass before it produced, a frozen dataclass,
and returns its own: the stage before plus what the pass adds (a subclass of it), so a pass
reads every earlier result and never calls back into an earlier pass's module. objects.py
lowers each object on its own, once, when its file is loaded (the loader caches the result on
the item); the passes put those pieces together.
"""

from .functions import served_functions
from .objects import lower
from .pipeline import compile_model

__all__ = ["compile_model", "lower", "served_functions"]

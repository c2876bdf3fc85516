"""Model specs, the op list of a decoder layer, and PyTorch models written as those ops.

The models live in `nanosched.models.model` (`CausalLM`; per-op interface in its docstring);
this package init stays light (no torch import) so pure-Python users of the specs stay fast.
"""

from nanosched.models.ops import COMPUTE, MEMORY, NETWORK, OTHER, OpDef, layer_ops
from nanosched.models.spec import REGISTRY, ModelSpec, load_spec, spec_from_hf_config

__all__ = ["COMPUTE", "MEMORY", "NETWORK", "OTHER", "OpDef", "layer_ops", "REGISTRY",
           "ModelSpec", "load_spec", "spec_from_hf_config"]

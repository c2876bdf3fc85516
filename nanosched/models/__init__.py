"""Model specifications, the op list of a decoder layer, and (later) PyTorch models."""

from nanosched.models.ops import COMPUTE, MEMORY, NETWORK, OTHER, OpDef, layer_ops
from nanosched.models.spec import REGISTRY, ModelSpec, load_spec, spec_from_hf_config

__all__ = ["COMPUTE", "MEMORY", "NETWORK", "OTHER", "OpDef", "layer_ops", "REGISTRY",
           "ModelSpec", "load_spec", "spec_from_hf_config"]

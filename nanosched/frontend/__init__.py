"""A torch.compile frontend: an unmodified PyTorch model, partitioned by annotation rules into
the named ops the scheduler runs (docs/design.md, "The frontend")."""

from nanosched.frontend.model import FrontendModel, FrontendWorkspace
from nanosched.frontend.rules import Rules, SplitFunc, SplitModule, mark

__all__ = ["FrontendModel", "FrontendWorkspace", "Rules", "SplitFunc", "SplitModule", "mark"]

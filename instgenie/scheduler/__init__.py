"""The mask-aware scheduler: everything that decides about cost and routing, without torch.

Placeholder while the modules move here; see the package docstring of the next commit.
"""

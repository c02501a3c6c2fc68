"""Everything that decides, as pure Python (no torch): step plans, pricing, routing."""

"""Template activation cache: the store interface, tiers (GPU/DRAM/disk) and the load planner."""

"""Model-family adapters: thin layers over diffusers pipelines, one file per family."""

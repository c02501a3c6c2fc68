"""Reference models: small `sdxl-inpaint` and `flux-fill` pipelines trained by this project on
its procedural editing dataset (instgenie/dataset), shipped as fp16 safetensors in diffusers layout
under instgenie/assets/ref/FAMILY and loaded as `FAMILY:ref` through the local-directory path.

    configs.py   the architectures (the full families' diffusers classes, small widths) and the
                 tokenizers whose vocabularies hold every dataset word as one token
    pool.py      the rendered training pool (scenes, captions, masks), made once per run
    train.py     VAE, then backbone + text towers, seeded; loss curves; save in fp16
    command.py   `instgenie train-reference`
"""

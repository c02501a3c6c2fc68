"""The procedural editing dataset (issue 27): try-on-like scenes drawn from a seed, with
captions that name what is where, inpainting masks and held-out combinations for evaluation.
`vocab.py` (what can be drawn), `scenes.py` (a scene as a value, its caption), `render.py`
(image and label map), `masks.py` (garment, rectangle and brush masks), `write.py` (files),
`command.py` (`instgenie dataset`). No torch, no downloads."""

"""What the procedural editing dataset can draw, and its names as captions say them.

Every attribute a caption names (garment colour, pattern, kind; wall colour and texture; the
object beside the figure and its colour) comes from these tables, so a classifier can be trained
on the labels and an edit prompt can ask for any combination. Colours are sRGB, 0-255.
"""

from __future__ import annotations

#: garment and object colours: name -> sRGB
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (200, 30, 35),
    "orange": (235, 125, 25),
    "yellow": (240, 210, 40),
    "green": (40, 150, 60),
    "blue": (35, 75, 190),
    "purple": (120, 50, 160),
    "pink": (235, 120, 170),
    "white": (240, 240, 235),
    "black": (25, 25, 30),
    "brown": (120, 75, 40),
}
#: how a garment's colour is laid out ("solid" has no second colour)
PATTERNS = ("solid", "striped", "checked", "dotted")
#: garment kinds: which body parts the garment covers (render.py draws them)
GARMENTS = ("t-shirt", "long-sleeved shirt", "tank top", "dress", "jacket")
#: wall colours: name -> sRGB
WALLS: dict[str, tuple[int, int, int]] = {
    "beige": (215, 200, 170),
    "grey": (160, 160, 160),
    "light blue": (170, 200, 225),
    "pale green": (185, 215, 180),
    "cream": (240, 232, 210),
    "dark": (70, 70, 80),
}
TEXTURES = ("plain", "brick", "panelled", "speckled")
#: objects beside the figure; None: only the figure
OBJECTS = ("plant", "lamp", "chair", "picture frame")
SKIN = ((241, 194, 155), (224, 172, 125), (198, 134, 90), (141, 85, 54), (95, 60, 40))
TROUSERS = ((40, 45, 70), (60, 60, 60), (110, 90, 70), (30, 30, 35))
FLOOR = (120, 95, 70)


def held_out(colour: str, pattern: str) -> bool:
    """Garment colour x pattern combinations kept for evaluation only: one in five, spread so
    that every colour and every pattern is also seen in training (with other partners)."""
    c, p = list(COLOURS).index(colour), PATTERNS.index(pattern)
    return (c + 2 * p) % 5 == 0

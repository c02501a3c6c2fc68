"""A scene of the procedural editing dataset as a value (`Scene`), how one is drawn from a seed
(`sample`), and what its caption says (`caption`). Pure Python: render.py draws it.

Geometry is in fractions of the image side (so one scene renders at any size); colours are
vocab.py names. A scene's split is "eval" when its garment's colour x pattern is held out
(vocab.held_out), else "train": evaluation prompts name combinations the models never saw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from instgenie.dataset import vocab


@dataclass(frozen=True)
class Light:
    """A linear brightness ramp across the image: `low` on one side, `high` on the other, along
    `angle` degrees (0: left to right); 1.0 / 1.0 is neutral."""

    angle: float = 0.0
    low: float = 1.0
    high: float = 1.0


@dataclass(frozen=True)
class Scene:
    colour: str  # the garment's colour (vocab.COLOURS)
    pattern: str  # vocab.PATTERNS
    garment: str  # vocab.GARMENTS
    wall: str  # vocab.WALLS
    texture: str  # vocab.TEXTURES
    #: the object beside the figure (vocab.OBJECTS) or None, its colour, and its side
    obj: str | None
    obj_colour: str
    obj_side: str  # "left" | "right"
    x: float  # the figure's centre, fraction of the width
    height: float  # the figure's height, fraction of the side
    skin: int  # index into vocab.SKIN
    trousers: int  # index into vocab.TROUSERS
    #: the pattern's second colour: "white" or "black" (contrast with the garment's)
    accent: str
    pattern_scale: float  # stripe / check / dot period, fraction of the side
    light: Light
    noise: float  # sensor noise, standard deviation in 8-bit levels
    seed: int  # for the texture and noise

    @property
    def split(self) -> str:
        return "eval" if vocab.held_out(self.colour, self.pattern) else "train"

    def garment_words(self) -> str:
        pattern = "" if self.pattern == "solid" else f"{self.pattern} "
        return f"{self.colour} {pattern}{self.garment}"


def sample(rng: random.Random, seed: int) -> Scene:
    """One scene, every attribute drawn from `rng` (uniform over the vocabularies)."""
    colour = rng.choice(list(vocab.COLOURS))
    obj = rng.choice((*vocab.OBJECTS, None))
    x = rng.uniform(0.38, 0.62)
    return Scene(
        colour=colour,
        pattern=rng.choice(vocab.PATTERNS),
        garment=rng.choice(vocab.GARMENTS),
        wall=rng.choice(list(vocab.WALLS)),
        texture=rng.choice(vocab.TEXTURES),
        obj=obj,
        obj_colour=rng.choice([c for c in vocab.COLOURS if c != colour]),
        obj_side=rng.choice(("left", "right")),
        x=x,
        height=rng.uniform(0.72, 0.86),
        skin=rng.randrange(len(vocab.SKIN)),
        trousers=rng.randrange(len(vocab.TROUSERS)),
        accent="black" if colour in ("white", "yellow", "pink") else "white",
        pattern_scale=rng.uniform(0.035, 0.06),
        light=Light(rng.uniform(0, 360), rng.uniform(0.75, 0.95), rng.uniform(1.0, 1.12)),
        noise=rng.uniform(0.0, 4.0),
        seed=seed,
    )


def caption(s: Scene) -> str:
    """What the scene shows, in the words an edit prompt uses: "a person in a red striped
    t-shirt on a beige brick wall, a blue lamp on the left"."""
    wall = s.wall if s.texture == "plain" else f"{s.wall} {s.texture}"
    text = f"a person in {_a(s.garment_words())} on {_a(wall)} wall"
    if s.obj is not None:
        obj = "green plant" if s.obj == "plant" else f"{s.obj_colour} {s.obj}"
        text += f", {_a(obj)} on the {s.obj_side}"
    return text


def _a(words: str) -> str:
    return ("an " if words[0] in "aeiou" else "a ") + words


def labels(s: Scene) -> dict[str, str | None]:
    """What a classifier of the edited region predicts (colour, pattern, garment), and the
    scene's other named attributes."""
    return {"colour": s.colour, "pattern": s.pattern, "garment": s.garment, "wall": s.wall,
            "texture": s.texture, "object": s.obj,
            "object_colour": s.obj_colour if s.obj not in (None, "plant") else None}  # fmt: skip

"""A local stand-in for TinyStories: simple children's stories from a small templated grammar.

``write_stories(out_dir)`` writes ``train.txt`` and ``val.txt`` in the format TinyStories is released in
(``TinyStoriesV2-GPT4-train.txt``): stories one after another, each followed by a line holding only
``<|endoftext|>``, which lmforge's text reader splits into one document per story
(``lmforge.data.sources``). Every story has a beginning (a child or an animal, a place, a thing they
love), a problem (something lost, stuck, broken, not shared, a storm, a fall, a fright, a hurt bird,
something out of reach, the way home lost) and its resolution, often with a helper, a few lines of talk,
and an ending. The vocabulary stays childlike: a few hundred words (``write_stories`` reports the count).
Everything is drawn from one seeded ``random.Random``: the same seed writes the same bytes.

It is no replacement for the real corpus (2.1M stories written by GPT-4, ~1,500 basic words), but it
has the same shape, so the language stage of seed 004 can run end to end without a download.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.errors import LMForgeError

SEPARATOR = "<|endoftext|>"
STORIES_FILE = "stories.json"  # what wrote the directory, with its counts
# --n at most: 5x TinyStories' 2.1M stories, ~6.5 GB of text; 1e9 would be ~650 GB and a day of work
MAX_STORIES = 10_000_000

GIRLS = ("Lily", "Mia", "Anna", "Sue", "Lucy", "Zoe", "Emma", "Amy", "Kate", "Rose", "Sara", "Jen")
BOYS = ("Tom", "Ben", "Sam", "Tim", "Max", "Leo", "Jack", "Bob", "Dan", "Joe", "Finn", "Jake")
ANIMALS = ("dog", "cat", "bunny", "bird", "bear", "duck", "frog", "fox", "mouse", "pig")
PET_NAMES = ("Spot", "Fluffy", "Buddy", "Daisy", "Coco", "Pip", "Sunny", "Rex", "Milo", "Bella", "Nibbles", "Tuff")
TRAITS = ("little", "kind", "shy", "brave", "curious", "happy", "silly", "small", "sweet", "gentle", "playful",
          "clever")
COLORS = ("red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "brown", "shiny")
# (noun, can it fly off in the wind, can it break)
THINGS = (("ball", True, False), ("kite", True, False), ("hat", True, False), ("shell", False, True),
          ("toy car", False, True), ("teddy bear", False, False), ("boat", False, True), ("doll", False, True),
          ("drum", False, True), ("book", False, False), ("truck", False, True), ("cup", False, True),
          ("balloon", True, False), ("scarf", True, False))
# (place, preposition, things seen there, something to do there)
PLACES = (
    ("park", "in", ("tall trees", "a big slide", "green grass"), "ran on the grass"),
    ("garden", "in", ("pretty flowers", "busy bees", "tall sunflowers"), "looked at the flowers"),
    ("forest", "in", ("big trees", "soft moss", "little mushrooms"), "walked under the trees"),
    ("beach", "at", ("soft sand", "blue waves", "white shells"), "dug in the sand"),
    ("farm", "on", ("a red barn", "cows and sheep", "a pile of hay"), "fed the hens"),
    ("pond", "by", ("green frogs", "quiet ducks", "tall reeds"), "threw little stones in the water"),
    ("hill", "on", ("soft grass", "a big rock", "wild flowers"), "rolled down the grass"),
    ("meadow", "in", ("yellow flowers", "happy butterflies", "soft grass"), "chased the butterflies"),
    ("yard", "in", ("a swing", "a sandbox", "an apple tree"), "played on the swing"),
    ("river", "by", ("fast water", "smooth stones", "a little bridge"), "sat on the bridge"),
)
GROWNUPS = ("mom", "dad", "grandma", "grandpa")
FEEL_BAD = ("sad", "worried", "upset")
FEEL_GOOD = ("happy", "glad", "proud")
OPENERS = ("Once upon a time, there was {a_hero}.", "There once was {a_hero}.",
           "One day, {a_hero} went to the {place}.", "Long ago, in a small town, there lived {a_hero}.")
WEATHER = ("The sun was warm and the sky was blue.", "It was a bright and sunny day.",
           "The wind was soft and the birds were singing.", "It was a cool morning and the grass was wet.")


@dataclass
class Being:
    name: str
    kind: str  # girl | boy | an animal
    trait: str

    @property
    def girl(self) -> bool:
        return self.kind == "girl" or (self.kind not in ("boy", "girl") and self.name in _GIRL_PETS)

    @property
    def he(self) -> str:
        return "she" if self.girl else "he"

    @property
    def him(self) -> str:
        return "her" if self.girl else "him"

    @property
    def his(self) -> str:
        return "her" if self.girl else "his"

    def a(self) -> str:
        return f"{_a(self.trait)} {self.trait} {self.kind} named {self.name}"


_GIRL_PETS = {"Fluffy", "Daisy", "Coco", "Sunny", "Bella"}


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


class _Story:
    """One story's choices and its sentences."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.hero = self.being()
        self.friend = self.being(not_name=self.hero.name)
        self.grownup = rng.choice(GROWNUPS)
        self.place, self.prep, self.sights, self.activity = rng.choice(PLACES)
        self.thing, self.flies, self.breaks = rng.choice(THINGS)
        self.color = rng.choice(COLORS)

    def being(self, not_name: str = "") -> Being:
        r = self.rng
        roll = r.random()
        if roll < 0.4:
            kind, names = "girl", GIRLS
        elif roll < 0.8:
            kind, names = "boy", BOYS
        else:
            kind, names = r.choice(ANIMALS), PET_NAMES
        name = r.choice([n for n in names if n != not_name])
        return Being(name, kind, r.choice(TRAITS))

    def pick(self, *options: str) -> str:
        return self.rng.choice(options)

    @property
    def obj(self) -> str:
        return f"{self.color} {self.thing}"

    # ---- the three parts ------------------------------------------------------------------------
    def beginning(self) -> list[str]:
        h, f = self.hero, self.friend
        opener = self.pick(*OPENERS)
        out = [opener.format(a_hero=h.a(), place=self.place)]
        out.append(self.pick(
            f"{_cap(h.he)} loved {h.his} {self.obj} more than anything.",
            f"{_cap(h.he)} had {_a(self.color)} {self.obj} that {h.he} took everywhere.",
            f"{h.name} liked to play with {h.his} {self.obj} every day.",
        ))
        out.append(self.pick(*WEATHER))
        if "{place}" in opener:  # already there
            out.append(f"There {h.he} met {h.his} friend {f.name}.")
        else:
            out.append(self.pick(
                f"{h.name} and {h.his} friend {f.name} went to the {self.place} to play.",
                f"{_cap(h.he)} went to the {self.place} with {h.his} friend {f.name}.",
                f"{h.name} met {h.his} friend {f.name} {self.prep} the {self.place}.",
            ))
        out.append(self.pick(f"They saw {self.rng.choice(self.sights)}.", f"They {self.activity}."))
        return out

    def problem_and_resolution(self) -> tuple[list[str], list[str]]:
        plots = [self.lost, self.shared, self.storm, self.fall, self.fright, self.bird, self.reach, self.way_home]
        if self.flies:
            plots.append(self.wind)
        if self.breaks:
            plots.append(self.broken)
        return self.rng.choice(plots)()

    def ending(self, lesson: str) -> list[str]:
        h, f = self.hero, self.friend
        out = [self.pick(
            f"From that day on, {h.name} and {f.name} were best friends.",
            f"They played {self.prep} the {self.place} until the sun went down.",
            f"That night, {h.name} went to bed with a big smile.",
            f"{h.name} went home and told {h.his} {self.grownup} all about it.",
            "It was a happy day.",
        )]
        if lesson and self.rng.random() < 0.6:
            out.append(f"{h.name} learned that {lesson}.")
        return out

    # ---- problems, each with its resolution ----------------------------------------------------------
    def lost(self) -> tuple[list[str], list[str]]:
        h, f = self.hero, self.friend
        problem = [f"After a while, {h.name} looked for {h.his} {self.thing}, but it was gone!",
                   f"{_cap(h.he)} looked under the bushes and behind the rocks, but {h.he} could not find it.",
                   f"{h.name} felt very {self.pick(*FEEL_BAD)}. \"Where is my {self.thing}?\" {h.he} cried."]
        spot = self.pick("under a big leaf", "behind a tree", "in the tall grass", "next to a rock")
        fix = [f"\"Do not worry, I will help you,\" said {f.name}.",
               f"They looked together. Then {f.name} saw something {self.color} {spot}.",
               f"It was the {self.thing}! {h.name} was so {self.pick(*FEEL_GOOD)}.",
               f"\"Thank you, {f.name}!\" {h.he} said, and gave {f.name} a big hug."]
        return problem, fix + self.ending("friends help each other")

    def shared(self) -> tuple[list[str], list[str]]:
        h, f = self.hero, self.friend
        problem = [f"{f.name} saw the {self.obj} and said, \"Can I play with it too?\"",
                   f"\"No, it is mine!\" said {h.name}, and {h.he} held it close.",
                   f"{f.name} felt {self.pick(*FEEL_BAD)} and sat down alone.",
                   f"{h.name} played by {h.him}self, but it was not fun anymore."
                   if h.kind in ("girl", "boy") else f"{h.name} played alone, but it was not fun anymore."]
        fix = [f"{h.name} looked at {f.name} and felt bad.",
               f"{_cap(h.he)} walked over and said, \"I am sorry. Let's play together.\"",
               f"{f.name} smiled, and they took turns with the {self.thing}.",
               "Playing together was much more fun than playing alone."]
        return problem, fix + self.ending("sharing makes everyone happy")

    def storm(self) -> tuple[list[str], list[str]]:
        h, f = self.hero, self.friend
        problem = ["Then big dark clouds came over the sky.",
                   f"Soon it began to rain, and the wind was cold. {h.name} and {f.name} were {self.pick('scared', 'wet', 'cold')}.",
                   f"\"What do we do now?\" asked {f.name}."]
        shelter = self.pick("under a big tree", "into a little shed", "under a wide bridge", "into a warm barn")
        fix = [f"{h.name} held {f.name}'s hand and said, \"Come with me!\"",
               f"They ran {shelter} and waited together.",
               "After a while, the rain stopped and the sun came out. They saw a big rainbow in the sky.",
               f"\"Look how pretty it is!\" said {h.name}. They both laughed."]
        return problem, fix + self.ending("storms do not last forever")

    def fall(self) -> tuple[list[str], list[str]]:
        h = self.hero
        problem = [f"{h.name} ran very fast with {h.his} {self.thing}.",
                   f"Then {h.he} tripped on a rock and fell down. {_cap(h.his)} knee hurt a lot.",
                   f"{h.name} began to cry."]
        fix = [f"{_cap(h.his)} {self.grownup} came running. \"Oh no, are you hurt?\"",
               f"{_cap(h.his)} {self.grownup} gave {h.him} a big hug and put a bandage on {h.his} knee.",
               f"Soon {h.name} felt better. \"Thank you,\" {h.he} said with a smile.",
               f"After that, {h.name} walked a little slower."]
        return problem, fix + self.ending("it is good to be careful")

    def fright(self) -> tuple[list[str], list[str]]:
        h, f = self.hero, self.friend
        critter = self.pick("a little hedgehog", "a baby goat", "a small turtle", "a tiny puppy", "an old owl")
        problem = [f"Suddenly, {h.name} heard a strange noise in the bushes.",
                   f"\"What was that?\" {h.he} asked. {_cap(h.he)} felt very scared.",
                   f"{f.name} was scared too, and the two friends held hands."]
        fix = [f"{h.name} was brave. {_cap(h.he)} looked into the bushes.",
               f"It was only {critter}! It was scared too.",
               f"\"Hello, little friend,\" said {h.name} in a soft voice. \"We will not hurt you.\"",
               f"The {critter.split()[-1]} came out and played with them all day."]
        return problem, fix + self.ending("new things are not always scary")

    def bird(self) -> tuple[list[str], list[str]]:
        h = self.hero
        problem = [f"Then {h.name} saw a little bird on the ground.",
                   "The bird had a hurt wing and could not fly.",
                   f"{h.name} felt {self.pick(*FEEL_BAD)} for the bird. \"Poor little bird,\" {h.he} said."]
        fix = [f"{h.name} picked up the bird very gently and took it home.",
               f"{_cap(h.he)} and {h.his} {self.grownup} made a soft bed for it in a box and gave it water and seeds.",
               "Every day the bird got a little better. One morning, it could fly again!",
               f"The bird sang a happy song for {h.name} and flew up into the sky."]
        return problem, fix + self.ending("it is good to be kind to animals")

    def reach(self) -> tuple[list[str], list[str]]:
        h, f = self.hero, self.friend
        food = self.pick("a red apple", "a big cookie", "a sweet pear", "a jar of honey")
        high = self.pick("on a high shelf", "at the top of a tree", "on top of a tall box")
        problem = [f"{h.name} saw {food} {high}.",
                   f"{_cap(h.he)} wanted it very much, but {h.he} was too small to reach it.",
                   f"{_cap(h.he)} jumped and jumped, but it was no use."]
        fix = [f"{f.name} came over and said, \"Let's do it together!\"",
               f"{f.name} held a chair still, and {h.name} climbed up and got it.",
               "They sat down and shared it. It was the best treat ever.",
               f"\"We make a good team,\" said {f.name}."]
        return problem, fix + self.ending("two friends can do more than one")

    def way_home(self) -> tuple[list[str], list[str]]:
        h = self.hero
        guide = self.pick("a wise old owl", "a kind dog", "a friendly cow", "a big brown horse")
        problem = [f"{h.name} walked far away from the {self.place} to look at the {self.pick('flowers', 'birds', 'clouds')}.",
                   f"When {h.he} turned around, {h.he} did not know where {h.he} was.",
                   f"\"I am lost,\" {h.he} said, and {h.he} felt very {self.pick('scared', 'worried', 'sad')}."]
        fix = [f"Just then, {guide} came by. \"Why are you sad?\" it asked.",
               f"\"I cannot find my way home,\" said {h.name}.",
               f"\"Follow me,\" said the {guide.split()[-1]}. It took {h.him} all the way back.",
               f"{_cap(h.his)} {self.grownup} was waiting at the door and gave {h.him} a big hug."]
        return problem, fix + self.ending("it is best to stay close to home")

    def wind(self) -> tuple[list[str], list[str]]:
        h, f = self.hero, self.friend
        problem = [f"Then a big wind came. It took the {self.obj} high up into a tall tree!",
                   f"{h.name} could not reach it. \"My {self.thing}!\" {h.he} said. {_cap(h.he)} was very {self.pick(*FEEL_BAD)}."]
        fix = self.pick(
            [f"{f.name} had an idea. \"Let's ask your {self.grownup} for help.\"",
             f"{_cap(h.his)} {self.grownup} came with a long ladder and got the {self.thing} down."],
            [f"A little bird saw the {self.thing} in the tree.",
             f"The bird pushed it with its beak, and the {self.thing} fell down into {h.name}'s hands."],
            [f"{f.name} shook the tree as hard as {f.he} could.",
             f"The {self.thing} fell down, and {h.name} caught it."])
        fix = list(fix) + [f"{h.name} was so {self.pick(*FEEL_GOOD)} to have {h.his} {self.thing} back."]
        return problem, fix + self.ending("help can come from anyone")

    def broken(self) -> tuple[list[str], list[str]]:
        h = self.hero
        problem = [f"Oh no! {h.name} dropped the {self.obj} and it broke.",
                   f"{h.name} was very {self.pick(*FEEL_BAD)}. {_cap(h.he)} began to cry."]
        fix = [f"{_cap(h.his)} {self.grownup} saw the broken {self.thing}. \"Let's fix it together,\" said {h.his} {self.grownup}.",
               "They used some glue and a lot of care.",
               f"Soon the {self.thing} was as good as new! {h.name} was so {self.pick(*FEEL_GOOD)}.",
               f"\"Thank you!\" said {h.name}, and {h.he} held it very gently."]
        return problem, fix + self.ending("broken things can often be fixed")

    def text(self) -> str:
        problem, resolution = self.problem_and_resolution()
        return "\n\n".join(" ".join(part) for part in (self.beginning(), problem, resolution))


def iter_stories(n_stories: int, seed: int = 0) -> Iterator[str]:
    """``n_stories`` stories from one seeded generator (the same seed gives the same stories), one at a time."""
    rng = random.Random(seed)
    return (_Story(rng).text() for _ in range(n_stories))


def generate_stories(n_stories: int, seed: int = 0) -> list[str]:
    """``iter_stories`` as a list."""
    return list(iter_stories(n_stories, seed))


def vocabulary(texts) -> set[str]:
    """The distinct words (lower-cased letters runs) of some texts."""
    words: set[str] = set()
    for text in texts:
        words.update(re.findall(r"[a-z]+", text.lower()))
    return words


def format_stories(stories: list[str]) -> str:
    """The released TinyStories layout: each story, then a line holding only <|endoftext|>."""
    return "".join(f"{story}\n{SEPARATOR}\n" for story in stories)


def write_stories(out_dir: str | Path, n_stories: int = 20000, seed: int = 0, val_fraction: float = 0.02,
                  overwrite: bool = False, show_progress: bool = False) -> dict[str, Any]:
    """Write ``train.txt`` and ``val.txt`` (the last ``val_fraction`` of the stories, at least one when
    there are two or more) and ``stories.json`` into ``out_dir``; returns the counts. A non-empty
    ``out_dir`` is refused unless ``overwrite``, and even then unless it is an earlier output of this.
    Each story is written as it is made: memory holds only the words seen and one hash a story."""
    from tqdm import tqdm

    from lmforge.files import atomic_directory

    if n_stories < 1:
        raise LMForgeError(f"--n must be >= 1, got {n_stories}")
    if n_stories > MAX_STORIES:
        raise LMForgeError(f"--n {n_stories:,} is more than {MAX_STORIES:,}, the most this writes (5x TinyStories' "
                           f"2.1M stories): at ~650 bytes a story that is ~{n_stories * 650 / 1e9:,.0f} GB of text "
                           f"and hours of work; ask for at most {MAX_STORIES:,}")
    if not 0.0 <= val_fraction < 1.0:
        raise LMForgeError(f"val_fraction must be in [0, 1), got {val_fraction}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LMForgeError(f"--out {out} is a file; choose a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise LMForgeError(f"--out {out} already exists and is not empty; refusing to overwrite it. Pass "
                               "--overwrite to replace it, or choose another --out directory")
        if not (out / STORIES_FILE).is_file():
            raise LMForgeError(f"--out {out} is not empty and was not written by `lmforge data stories` (no "
                               f"{STORIES_FILE}); --overwrite only replaces an earlier output. Choose another --out")
    n_val = 0 if val_fraction == 0 or n_stories < 2 else min(n_stories - 1, max(1, round(n_stories * val_fraction)))
    words: set[str] = set()
    hashes: set[int] = set()  # for the distinct count; a collision (odds ~n^2/2^65) would count one story less
    sizes = {"train": 0, "val": 0}
    bar = tqdm(iter_stories(n_stories, seed), total=n_stories, desc="writing", unit=" stories",
               disable=not show_progress)
    with atomic_directory(out) as tmp:
        with open(tmp / "train.txt", "w", encoding="utf-8") as train, \
                open(tmp / "val.txt", "w", encoding="utf-8") as val:
            for i, story in enumerate(bar):
                split = "train" if i < n_stories - n_val else "val"
                text = format_stories([story])
                (train if split == "train" else val).write(text)
                sizes[split] += len(text.encode("utf-8"))
                hashes.add(hash(story))
                words.update(vocabulary([story]))
        bar.close()
        report = {"generator": "lmforge data stories", "seed": seed, "val_fraction": val_fraction,
                  "train_stories": n_stories - n_val, "val_stories": n_val, "distinct_stories": len(hashes),
                  "vocabulary": len(words), "separator": SEPARATOR,
                  "train_bytes": sizes["train"], "val_bytes": sizes["val"]}
        (tmp / STORIES_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return {**report, "out": str(out), "train": str(out / "train.txt"), "val": str(out / "val.txt")}


def add_cli(data_verbs) -> None:
    """``lmforge data stories``: registered by ``lmforge.cli_data``."""
    p = data_verbs.add_parser(
        "stories", help="write a local stand-in for TinyStories (simple generated children's stories)",
        description="Generate simple children's stories from a small templated grammar (a few hundred words; "
                    "beginning, problem, resolution) into DIR/train.txt and DIR/val.txt, each story followed by a "
                    "line <|endoftext|> as in the released TinyStoriesV2-GPT4-train.txt, which lmforge reads as "
                    "one document per story. Deterministic for a seed.")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory; must be new or empty unless "
                   "--overwrite (required)")
    p.add_argument("--n", type=int, default=20000, metavar="N", help="number of stories, train and val together, "
                   f"at most {MAX_STORIES:,} (default: 20000)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default: 0)")
    p.add_argument("--val-fraction", type=float, default=0.02, metavar="F",
                   help="share of the stories in val.txt, at least one (default: 0.02)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier output of this verb in --out (default: refuse a non-empty --out)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="hide the progress bar (default: shown)")
    p.set_defaults(func=_cmd_stories)


def _cmd_stories(args) -> int:
    r = write_stories(args.out, n_stories=args.n, seed=args.seed, val_fraction=args.val_fraction,
                      overwrite=args.overwrite, show_progress=args.progress)
    print(f"stories: {r['out']} (seed {r['seed']})")
    print(f"  train.txt: {r['train_stories']} stories, {r['train_bytes']:,} bytes")
    print(f"  val.txt: {r['val_stories']} stories, {r['val_bytes']:,} bytes")
    print(f"  {r['distinct_stories']} distinct stories, {r['vocabulary']} distinct words")
    return 0

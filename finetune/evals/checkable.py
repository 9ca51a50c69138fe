"""The checkable question set: short questions with one known answer (capitals, arithmetic, units, opposites,
calendar, plurals, colours, facts) and `check`, which finds an accepted answer in a model's free text. Used by
`finetune.evals.evaluate --suite natural` for checkable accuracy; it lives beside `finetune.evals.natural`, whose
prompts have no single right answer. Its question forms and subjects are ones the prompt generator never produces, so it
is held out from training by construction (a test checks that no checkable question is a training prompt)."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckItem:
    """A question with a short known answer; `answers` lists every accepted form (lower case)."""
    prompt: str
    answers: tuple[str, ...]
    kind: str                      # capital | arithmetic | unit | opposite | calendar | plural | colour | ...
    numeric: bool = False


CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
    "the United Kingdom": "London", "Russia": "Moscow", "China": "Beijing", "Egypt": "Cairo",
    "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin", "Austria": "Vienna", "Norway": "Oslo",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen", "Poland": "Warsaw",
    "Hungary": "Budapest", "the Czech Republic": "Prague", "Belgium": "Brussels", "the Netherlands": "Amsterdam",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Argentina": "Buenos Aires", "Peru": "Lima", "Chile": "Santiago",
    "Colombia": "Bogotá", "Cuba": "Havana", "India": "New Delhi", "Thailand": "Bangkok", "South Korea": "Seoul",
    "Indonesia": "Jakarta", "the Philippines": "Manila", "Vietnam": "Hanoi", "Iran": "Tehran", "Iraq": "Baghdad",
    "Turkey": "Ankara", "Kenya": "Nairobi", "Ethiopia": "Addis Ababa", "Australia": "Canberra",
    "New Zealand": "Wellington", "Switzerland": "Bern", "Ukraine": "Kyiv", "Romania": "Bucharest",
    "Saudi Arabia": "Riyadh", "Pakistan": "Islamabad", "Brazil": "Brasília", "Venezuela": "Caracas",
    "Morocco": "Rabat", "Nigeria": "Abuja", "Ghana": "Accra", "Iceland": "Reykjavik", "Scotland": "Edinburgh",
    "Wales": "Cardiff", "Israel": "Jerusalem", "Syria": "Damascus", "Lebanon": "Beirut", "Nepal": "Kathmandu",
    "Bangladesh": "Dhaka", "Jamaica": "Kingston", "Malaysia": "Kuala Lumpur", "Singapore": "Singapore",
    "Qatar": "Doha", "Jordan": "Amman", "Afghanistan": "Kabul", "Bulgaria": "Sofia", "Serbia": "Belgrade",
    "Croatia": "Zagreb", "Slovakia": "Bratislava", "Latvia": "Riga", "Lithuania": "Vilnius", "Estonia": "Tallinn",
    "Uruguay": "Montevideo", "Paraguay": "Asunción", "Ecuador": "Quito", "Bolivia": "Sucre", "Senegal": "Dakar",
    "Tunisia": "Tunis", "Algeria": "Algiers",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "happy": "sad", "fast": "slow", "light": "dark",
    "open": "closed", "early": "late", "full": "empty", "hard": "soft", "old": "young", "rich": "poor",
    "strong": "weak", "tall": "short", "wet": "dry", "loud": "quiet", "thick": "thin", "heavy": "light",
    "inside": "outside", "win": "lose", "love": "hate", "day": "night", "left": "right", "push": "pull",
    "true": "false", "begin": "end", "buy": "sell", "clean": "dirty", "cheap": "expensive", "north": "south",
    "east": "west", "above": "below", "first": "last", "laugh": "cry", "friend": "enemy", "give": "take",
    "near": "far", "safe": "dangerous", "sweet": "sour", "awake": "asleep", "long": "short", "high": "low",
    "question": "answer", "arrive": "leave", "remember": "forget", "accept": "reject", "increase": "decrease",
    "wide": "narrow", "deep": "shallow", "smooth": "rough", "black": "white", "good": "bad", "yes": "no",
    "always": "never", "before": "after", "come": "go", "boy": "girl", "king": "queen", "sunrise": "sunset",
    "summer": "winter",
}
PLURALS = {"child": "children", "mouse": "mice", "tooth": "teeth", "foot": "feet", "man": "men",
           "woman": "women", "goose": "geese", "person": "people", "box": "boxes", "city": "cities",
           "leaf": "leaves", "knife": "knives", "baby": "babies", "bus": "buses", "wolf": "wolves",
           "dish": "dishes", "potato": "potatoes", "fox": "foxes", "church": "churches", "party": "parties",
           "cat": "cats", "dog": "dogs", "car": "cars", "book": "books", "house": "houses", "tree": "trees",
           "apple": "apples", "glass": "glasses", "dress": "dresses", "wish": "wishes", "lady": "ladies",
           "story": "stories", "wife": "wives", "shelf": "shelves", "hero": "heroes", "ox": "oxen",
           "sheep": "sheep", "fish": "fish", "deer": "deer", "cactus": "cacti"}
UNITS = [
    ("How many minutes are in an hour?", "60"), ("How many seconds are in a minute?", "60"),
    ("How many hours are in a day?", "24"), ("How many days are in a week?", "7"),
    ("How many months are in a year?", "12"), ("How many centimetres are in a metre?", "100"),
    ("How many millimetres are in a centimetre?", "10"), ("How many metres are in a kilometre?", "1000"),
    ("How many grams are in a kilogram?", "1000"), ("How many millilitres are in a litre?", "1000"),
    ("How many days are in a leap year?", "366"), ("How many days are in a normal year?", "365"),
    ("How many weeks are in a year?", "52"), ("How many years are in a century?", "100"),
    ("How many years are in a decade?", "10"), ("How many sides does a triangle have?", "3"),
    ("How many sides does a square have?", "4"), ("How many sides does a hexagon have?", "6"),
    ("How many legs does a spider have?", "8"), ("How many legs does an insect have?", "6"),
    ("How many continents are there?", "7"), ("How many players are on a football team on the field?", "11"),
    ("How many cents are in a dollar?", "100"), ("How many inches are in a foot?", "12"),
    ("How many zeros are in one million?", "6"), ("How many degrees are in a right angle?", "90"),
    ("How many strings does a standard guitar have?", "6"), ("How many planets are in the solar system?", "8"),
    ("How many colours are in a rainbow?", "7"), ("How many letters are in the English alphabet?", "26"),
]
COLOURS = [
    ("What colour is the sky on a clear day?", "blue"), ("What colour are bananas when they are ripe?", "yellow"),
    ("What colour is grass?", "green"), ("What colour is snow?", "white"), ("What colour is coal?", "black"),
    ("What colour are most fire trucks?", "red"), ("What colour do you get by mixing blue and yellow?", "green"),
    ("What colour do you get by mixing red and white?", "pink"), ("What colour is a ripe tomato?", "red"),
    ("What colour is milk?", "white"), ("What colour are carrots?", "orange"),
    ("What colour do you get by mixing red and yellow?", "orange"),
]
FACTS = [
    ("What is the chemical symbol for water?", ("h2o",)),
    ("What gas do plants take in from the air?", ("carbon dioxide", "co2")),
    ("What is the largest planet in the solar system?", ("jupiter",)), ("What is the closest star to Earth?", ("sun",)),
    ("What is frozen water called?", ("ice",)), ("What animal says 'moo'?", ("cow",)),
    ("What do bees make?", ("honey",)), ("Which planet is known as the Red Planet?", ("mars",)),
    ("What is the largest ocean on Earth?", ("pacific",)), ("What is the boiling point of water in Celsius?", ("100",)),
    ("What is the freezing point of water in Celsius?", ("0", "zero")),
    ("Which organ pumps blood through the body?", ("heart",)),
    ("What is the largest mammal?", ("blue whale", "whale")),
    ("What do caterpillars turn into?", ("butterfly", "butterflies", "moth")),
    ("Who wrote 'Romeo and Juliet'?", ("shakespeare",)), ("What is the tallest animal?", ("giraffe",)),
    ("What language is spoken in Brazil?", ("portuguese",)), ("What is the main language of Mexico?", ("spanish",)),
    ("What is the longest river in Africa?", ("nile",)), ("What is the hardest natural substance?", ("diamond",)),
    ("What do we call a baby cat?", ("kitten",)), ("What do we call a baby dog?", ("puppy",)),
    ("What animal is known as the king of the jungle?", ("lion",)), ("What do cows drink?", ("water",)),
    ("What is the largest desert in the world?", ("sahara", "antarctic", "antarctica")),
    ("What instrument has black and white keys?", ("piano",)),
    ("What do you use to write on a blackboard?", ("chalk",)),
    ("Which planet do we live on?", ("earth",)), ("What is the opposite of north on a compass?", ("south",)),
    ("What is the main gas in the air we breathe?", ("nitrogen",)),
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


def _checkable_catalogue() -> list[CheckItem]:
    items: list[CheckItem] = []
    for country, city in CAPITALS.items():
        items.append(CheckItem(f"What is the capital of {country}?", (city.lower(),), "capital"))
    for word, opp in OPPOSITES.items():
        items.append(CheckItem(f"What is the opposite of '{word}'?", (opp,), "opposite"))
    for word, plural in PLURALS.items():
        items.append(CheckItem(f"What is the plural of '{word}'?", (plural,), "plural"))
    for q, a in UNITS:
        items.append(CheckItem(q, (a,), "unit", numeric=True))
    for q, a in COLOURS:
        items.append(CheckItem(q, (a,), "colour"))
    for q, answers in FACTS:
        items.append(CheckItem(q, answers, "fact", numeric=answers[0].isdigit()))
    for i, day in enumerate(DAYS):
        items.append(CheckItem(f"What day comes after {day}?", (DAYS[(i + 1) % 7].lower(),), "calendar"))
        items.append(CheckItem(f"What day comes before {day}?", (DAYS[i - 1].lower(),), "calendar"))
    for i, month in enumerate(MONTHS):
        items.append(CheckItem(f"What month comes after {month}?", (MONTHS[(i + 1) % 12].lower(),), "calendar"))
    rng = random.Random("checkable-arithmetic")
    seen = set()
    while len(seen) < 60:
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        op = rng.choice("+-x")
        if op == "-" and a <= b:
            a, b = b + 1, a
        value = a + b if op == "+" else a - b if op == "-" else a * b
        if op == "x" and (a > 10 or b > 10):
            continue
        if value in (a, b) or (op, a, b) in seen:
            continue
        seen.add((op, a, b))
        text = {"+": f"What is {a} + {b}?", "-": f"What is {a} - {b}?", "x": f"What is {a} times {b}?"}[op]
        items.append(CheckItem(text, (str(value),), "arithmetic", numeric=True))
    return items


def checkable_set(n: int | None = None, seed: int = 0) -> list[CheckItem]:
    """`n` checkable items (all when None), shuffled by `seed`; held out from training by construction."""
    items = _checkable_catalogue()
    if n is not None and not 1 <= n <= len(items):
        raise ValueError(f"n={n!r}: the checkable set has {len(items)} items; ask for 1..{len(items)}")
    random.Random(f"checkable:{seed}").shuffle(items)
    return items if n is None else items[:n]


_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?![\w]|\.\d)")


def check(item: CheckItem, text: str) -> bool:
    """True iff `text` gives one of the item's answers.

    Words: an accepted answer appears as a whole word or phrase (case-insensitive; accents as written).
    Numbers: an accepted number appears as a whole number (commas as thousands separators allowed). The
    arithmetic items are drawn so that the answer is never one of the operands, so echoing the question
    does not count as right.
    """
    low = text.lower()
    if item.numeric:
        found = {m.group(0).replace(",", "") for m in _NUMBER.finditer(low)}
        words = {"0": "zero"}
        return any(a in found or (a in words and re.search(rf"\b{words[a]}\b", low)) for a in item.answers)
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", low) for a in item.answers)

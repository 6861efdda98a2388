"""Everyday requests of the kind users send a chat assistant, built deterministically with no download:
open questions about a broad set of subjects, how-to requests, places, short writing tasks and Python
questions, each template over its own list of slots. duospec/training/answers.py answers them (kind `open`)
next to its code and chat prompts, so a draft learns how the target talks when asked something that is
not about the standard library.

The demo's questions (duospec/demo.py) are measuring prompts: their subjects are left out of these lists,
and answers.py passes them to `open_prompt_texts` as `excluded`, so none is ever answered for training.
"""

from __future__ import annotations

import random

_SUBJECTS = (
    "the Great Wall of China", "the theory of evolution", "the printing press", "jazz music", "the Moon landing",
    "the Olympic Games", "dinosaurs", "the Renaissance", "gravity", "electricity", "the periodic table",
    "DNA", "the Industrial Revolution", "ancient Egypt", "the human heart", "rainbows", "tides", "bees",
    "the Amazon rainforest", "coral reefs", "the Cold War", "nuclear energy", "antibiotics", "the Silk Road",
    "impressionist painting", "Shakespeare", "the Beatles", "social media", "artificial intelligence",
    "blockchain", "quantum computing", "solar panels", "wind turbines", "the ozone layer", "glaciers",
    "hurricanes", "the Milky Way", "Mars", "the Big Bang", "plate tectonics", "the nervous system",
    "vitamins", "yoga", "chocolate", "tea", "olive oil", "the Internet of Things", "smartphones",
    "video games", "the stock exchange", "credit scores", "taxes", "minimum wage", "supply and demand",
    "the United Nations", "human rights", "the Renaissance artists", "classical music", "the violin",
    "origami", "photography", "film noir", "the novel", "poetry", "mythology", "the Vikings", "samurai",
    "the Aztecs", "the Middle Ages", "castles", "pyramids", "trains", "airplanes", "bicycles",
    "electric batteries", "3D printing", "robots", "self-driving cars", "space telescopes", "satellites",
    "GPS", "Wi-Fi", "email", "passwords", "privacy online", "remote work", "four-day work weeks",
    "procrastination", "motivation", "happiness", "friendship", "kindness", "empathy", "stress",
    "memory", "dreams", "habits", "creativity", "critical thinking", "leadership", "teamwork",
    "negotiation", "customer service", "small businesses", "marketing", "branding", "startups",
    "the scientific method", "statistics", "probability", "prime numbers", "fractions", "geometry",
    "algebra", "calculus", "the number zero", "infinity", "maps", "languages", "grammar", "punctuation",
)
_SKILLS = (
    "cooking rice", "saving money", "writing a resume", "learning to swim", "running a first 5K",
    "keeping a houseplant alive", "studying for an exam", "making new friends", "waking up early",
    "speaking in front of a crowd", "learning to play the guitar", "drawing portraits", "writing a short story",
    "taking better photos", "staying focused while working from home", "packing for a trip",
    "training a puppy", "baking cookies", "making coffee at home", "negotiating a salary", "cleaning a kitchen",
    "organizing a closet", "planning a birthday party", "reading more books", "learning to code",
    "debugging a program", "writing clear emails", "giving feedback to a colleague", "starting a blog",
    "growing tomatoes", "reducing screen time", "sleeping better", "eating more vegetables",
    "lifting weights safely", "stretching after exercise", "managing a small team", "preparing for a job interview",
    "learning Spanish", "memorizing vocabulary", "choosing a laptop", "keeping a journal", "meal prepping",
    "riding a bike in the city", "saving energy at home", "camping for the first time", "hiking in the mountains",
)
_COUNTRIES = (
    "Japan", "Italy", "Brazil", "Canada", "Egypt", "India", "Mexico", "Kenya", "Norway", "Australia",
    "Peru", "Greece", "Spain", "Germany", "Thailand", "Argentina", "Morocco", "Ireland", "Vietnam", "Turkey",
    "Portugal", "Chile", "South Korea", "New Zealand", "Iceland", "Sweden", "Poland", "Nigeria",
)
_CITIES = (
    "Rome", "Tokyo", "New York", "London", "Barcelona", "Istanbul", "Cairo", "Sydney", "Rio de Janeiro",
    "Amsterdam", "Prague", "Vienna", "Kyoto", "Lisbon", "Berlin", "Toronto", "Mumbai", "Bangkok",
)
_PYTHON = (
    "a dictionary", "a tuple", "a set", "a generator", "a decorator", "a lambda function", "a class",
    "inheritance", "an exception", "a context manager", "a virtual environment", "f-strings", "slicing",
    "the `with` statement", "type hints", "a module", "recursion", "a while loop", "the `zip` function",
    "the `enumerate` function", "string formatting", "reading a file", "a dataclass", "async and await",
)
_WRITING = (  # (what, "to" / "for" / "about", whom or what)
    ("a thank-you note", "to", "a friend who helped me move"), ("a short email", "to", "my manager asking for a day off"),
    ("a birthday message", "to", "my grandmother"), ("a product description", "for", "a reusable water bottle"),
    ("a short speech", "for", "a friend's wedding"), ("a cover letter opening", "for", "a junior designer job"),
    ("a tweet", "about", "a new bakery opening"), ("a polite complaint", "about", "a late delivery"),
    ("an apology", "for", "missing a meeting"), ("a welcome message", "to", "new members of a book club"),
    ("a limerick", "about", "a cat who loves boxes"), ("a short story opening", "about", "a lighthouse keeper"),
    ("a motivational message", "to", "students before exams"), ("a recipe introduction", "for", "an apple pie"),
)

_REQUESTS = {  # kind: (its slots, its templates)
    "subject": (_SUBJECTS, (
        "What is {x}?", "Explain {x} in two sentences.", "Why is {x} important?", "Tell me a fun fact about {x}.",
        "What are common misconceptions about {x}?", "How does {x} work?", "Write a short poem about {x}.",
        "What should a beginner know about {x}?", "Describe {x} to someone who has never heard of it.",
        "What is the history of {x} in a nutshell?",
    )),
    "skill": (_SKILLS, (
        "Give three tips for {x}.", "How do I get better at {x}?", "What are common mistakes when {x}?",
        "Write a step-by-step guide to {x}.", "I want to start {x}. Where should I begin?",
        "What are the benefits of {x}?",
    )),
    "country": (_COUNTRIES, (
        "What is the capital of {x}?", "What is {x} famous for?", "What food is {x} known for?",
        "Plan a one-week trip to {x}.", "Tell me about the history of {x} in a few sentences.",
    )),
    "city": (_CITIES, ("What should I see in {x} in one day?", "What is {x} known for?", "Describe {x} in a short paragraph.")),
    "python": (_PYTHON, (
        "Explain what {x} is in Python.", "Show a short Python example that uses {x}.",
        "When should I use {x} in Python?", "What are common mistakes with {x} in Python?",
    )),
    "writing": (_WRITING, ("Write {x[0]} {x[1]} {x[2]}.", "Please write {x[0]} {x[1]} {x[2]}, in a friendly tone.")),
}


def open_prompt_texts(excluded: frozenset[str] = frozenset()) -> list[str]:
    """Every request but `excluded`, in one fixed shuffled order (kinds interleaved, so any prefix is a mix)."""
    texts = [template.format(x=slot) for slots, templates in _REQUESTS.values()
             for slot in slots for template in templates]
    random.Random(2).shuffle(texts)
    return [t for t in texts if t not in excluded]

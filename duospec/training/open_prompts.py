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


# A second group, answered after the first: computing concepts, comparisons, animals, food, jobs, people,
# personal advice, lists and arithmetic. Shuffled apart, so adding it left the first group's order (and
# the data prefixes answered from it) as it was.
_CONCEPTS = (
    "an API", "a database index", "version control", "a Git branch", "a REST API", "JSON", "HTML", "CSS",
    "a compiler", "an operating system", "cloud computing", "encryption", "a hash function", "machine learning",
    "a neural network", "open source software", "unit testing", "code review", "a linked list", "binary search",
    "big O notation", "a stack", "a queue", "a hash table", "caching", "multithreading", "SQL", "a web server",
    "DNS", "HTTP", "a firewall", "containers", "the command line", "regular expressions",
    "object-oriented programming", "functional programming", "design patterns", "technical debt",
    "a memory leak", "a race condition", "an algorithm", "a variable", "a loop", "an array", "a pointer",
)
_PAIRS = (
    ("a virus", "a bacterium"), ("weather", "climate"), ("a lake", "a sea"), ("a crocodile", "an alligator"),
    ("RAM", "storage"), ("a CPU", "a GPU"), ("Python", "JavaScript"), ("a list", "a tuple"), ("SQL", "NoSQL"),
    ("TCP", "UDP"), ("a compiler", "an interpreter"), ("a process", "a thread"), ("Git", "GitHub"),
    ("speed", "velocity"), ("mass", "weight"), ("an atom", "a molecule"), ("a star", "a planet"),
    ("a comet", "an asteroid"), ("a democracy", "a monarchy"), ("a loan", "a grant"), ("saving", "investing"),
    ("a stock", "a bond"), ("a debit card", "a credit card"), ("baking soda", "baking powder"),
    ("a fruit", "a vegetable"), ("tea", "coffee"), ("a novel", "a short story"), ("a poem", "a song"),
    ("a violin", "a viola"), ("a cold", "the flu"), ("aerobic exercise", "strength training"),
    ("a frog", "a toad"), ("a rabbit", "a hare"), ("a dolphin", "a shark"), ("an ocean", "a sea"),
    ("a hurricane", "a tornado"), ("a city", "a town"), ("an email", "a letter"), ("a laptop", "a tablet"),
    ("a manager", "a leader"), ("a goal", "a habit"), ("empathy", "sympathy"), ("confidence", "arrogance"),
)
_ANIMALS = (
    "elephants", "penguins", "octopuses", "wolves", "owls", "dolphins", "honeybees", "ants", "whales",
    "giraffes", "koalas", "tigers", "lions", "parrots", "frogs", "turtles", "sharks", "horses", "cats",
    "dogs", "butterflies", "bats", "camels", "polar bears", "kangaroos", "foxes", "crows", "squirrels",
    "hedgehogs", "jellyfish", "snakes", "eagles", "zebras", "gorillas", "pandas", "seahorses", "otters",
)
_FOODS = (
    "pancakes", "pizza", "sushi", "tacos", "lasagna", "guacamole", "hummus", "banana bread", "fried rice",
    "tomato soup", "a smoothie", "scrambled eggs", "curry", "pad thai", "lemonade", "bread", "pasta",
    "a salad", "chili", "dumplings", "a sandwich", "oatmeal", "popcorn", "muffins", "ice cream",
)
_JOBS = (
    "nurse", "software engineer", "teacher", "architect", "pilot", "chef", "data scientist", "lawyer",
    "electrician", "firefighter", "journalist", "pharmacist", "accountant", "veterinarian", "librarian",
    "graphic designer", "project manager", "dentist", "plumber", "marine biologist", "translator",
    "carpenter", "police officer", "farmer", "web developer", "physiotherapist", "photographer",
)
_PEOPLE = (
    "Albert Einstein", "Marie Curie", "Isaac Newton", "Leonardo da Vinci", "Ada Lovelace", "Alan Turing",
    "Cleopatra", "Julius Caesar", "Mahatma Gandhi", "Nelson Mandela", "Martin Luther King Jr.",
    "Abraham Lincoln", "Charles Darwin", "Galileo Galilei", "William Shakespeare", "Mozart", "Beethoven",
    "Frida Kahlo", "Vincent van Gogh", "Pablo Picasso", "Nikola Tesla", "Thomas Edison", "Rosa Parks",
    "Genghis Khan", "Confucius", "Socrates", "Aristotle", "Jane Austen", "Mark Twain", "Amelia Earhart",
    "the Wright brothers", "Florence Nightingale", "Queen Victoria", "Alexander the Great", "Steve Jobs",
)
_TROUBLES = (
    "feel tired all the time", "can't decide what to study", "procrastinate on everything",
    "feel nervous before presentations", "have trouble sleeping", "keep forgetting things",
    "spend too much money online", "feel lonely after moving to a new city", "can't stay focused at work",
    "have too many emails", "argue with my roommate about chores", "want to change careers",
    "feel stuck learning to code", "get distracted by my phone", "have a job interview tomorrow",
    "don't have time to exercise", "want to eat healthier on a budget", "find it hard to say no",
    "am bored on weekends", "feel overwhelmed by my to-do list", "want to learn a new language quickly",
    "have a messy desk", "am starting a new job next week", "lost motivation for my hobby",
)
_THINGS = (
    "programming languages", "board games", "classic novels", "healthy snacks", "indoor hobbies",
    "famous paintings", "national parks", "inventions of the 20th century", "ways to save water",
    "renewable energy sources", "musical instruments", "team sports", "study techniques", "houseplants",
    "breakfast ideas", "science fiction movies", "careers in technology", "ways to reduce stress",
    "famous bridges", "tips for public speaking", "kitchen tools", "productivity apps", "planets",
    "Greek gods", "dog breeds", "types of clouds", "web browsers", "data structures",
)
_MORE_SUBJECTS = (
    "volcanoes", "earthquakes", "black holes", "the water cycle", "photosynthesis", "climate change",
    "recycling", "vaccines", "the immune system", "sleep", "meditation", "coffee", "the Roman Empire",
    "the printing of money", "inflation", "banks", "the solar system", "the speed of light", "magnets",
    "sound waves", "the human brain", "muscles", "bones", "the digestive system", "allergies", "fungi",
    "forests", "deserts", "rivers", "islands", "the Arctic", "the Sahara", "the Himalayas", "the Nile",
    "democracy", "elections", "newspapers", "podcasts", "libraries", "museums", "public transport",
    "electric cars", "recycled plastic", "compost", "organic farming", "fast fashion", "minimalism",
    "chess", "football", "basketball", "the marathon", "skateboarding", "ballet", "opera", "hip hop",
    "comic books", "animation", "typography", "architecture", "bridges", "skyscrapers", "the wheel",
    "the telephone", "the light bulb", "vaccination campaigns", "public speaking", "time management",
)
_MORE_REQUESTS = {
    "subject": (_MORE_SUBJECTS, _REQUESTS["subject"][1]),
    "concept": (_CONCEPTS, (
        "What is {x} in programming?", "Explain {x} to a beginner.", "Why do programmers use {x}?",
        "Give a simple example of {x}.", "Explain in two sentences what {x} is.", "How would you explain {x} to a child?",
    )),
    "pair": (_PAIRS, ("What is the difference between {x[0]} and {x[1]}?",
                      "How are {x[0]} and {x[1]} similar, and how are they different?")),
    "animal": (_ANIMALS, (
        "Tell me about {x}.", "Where do {x} live?", "What do {x} eat?", "Write a short children's story about {x}.",
        "Give three interesting facts about {x}.",
    )),
    "food": (_FOODS, ("How do I make {x}?", "What is the origin of {x}?", "Give me a simple recipe for {x}.",
                      "Is {x} healthy?")),
    "job": (_JOBS, ("What does a {x} do?", "How do I become a {x}?", "What skills does a {x} need?",
                    "Describe a typical day of a {x}.")),
    "person": (_PEOPLE, ("Who was {x}?", "What is {x} known for?", "Summarize the life of {x} in a paragraph.",
                         "Why is {x} important in history?")),
    "trouble": (_TROUBLES, ("I {x}. What should I do?", "What can I do if I {x}?", "Any advice? I {x}.")),
    "things": (_THINGS, ("List five {x}.", "Name three {x} and describe each briefly.",
                         "What are some popular {x}?", "Give three {x} for a beginner, with one reason each.")),
}

# A third group, answered after the second (appended the same way): new requests over the first two
# groups' slots, household and technology how-tos, travel questions, rewording tasks, and explanations
# of a topic for a given reader.
_HOME = (
    "unclog a drain", "remove a coffee stain from a shirt", "fix a squeaky door", "get rid of fruit flies",
    "keep bread fresh longer", "clean an oven", "hang a picture frame straight", "defrost a freezer",
    "wash a wool sweater", "organize a small kitchen", "keep a cat off the table", "lower my electricity bill",
    "make my room quieter", "choose a good mattress", "paint a wall", "get rid of a musty smell",
)
_TECH = (
    "back up my phone", "speed up a slow laptop", "make a strong password", "set up two-factor authentication",
    "improve my Wi-Fi signal", "free up space on my phone", "spot a phishing email", "share a large file",
    "take a screenshot on a laptop", "make a spreadsheet formula", "write a good search query",
    "protect my privacy on social media", "choose a password manager", "update my computer safely",
    "record my screen", "organize my photos", "set up a home printer", "clear my browser cache",
)
_READERS = (
    "a five-year-old", "a teenager", "my grandmother", "a busy manager", "a new employee", "a tourist",
    "someone who hates math", "a science student",
)
_TOPICS_TO_EXPLAIN = (
    "how vaccines work", "why the sky is blue", "how the Internet works", "what inflation is",
    "how airplanes fly", "why we have seasons", "how a credit card works", "what a black hole is",
    "how plants grow", "why we need sleep", "how a computer stores data", "what the stock market does",
    "how rain forms", "why leaves change color", "how a refrigerator works", "what an election is",
)
_REWORDINGS = (
    "I am writing to inform you that the meeting has been moved to Thursday.",
    "The results of the survey indicate that most customers are satisfied with the service.",
    "Please make sure all the dishes are washed before you leave the kitchen.",
    "Our team has been working hard on the new app and we think you will love it.",
    "The weather was bad so the football game was cancelled and everyone went home early.",
    "I would like to return this jacket because it is too small for me.",
    "Regular exercise can improve your mood, your sleep and your energy levels.",
    "The library will be closed on Monday for maintenance work on the heating system.",
    "Thank you for your patience while we fixed the problem with your order.",
    "Learning a new language takes time, practice and a lot of patience.",
)
_THIRD_REQUESTS = {
    "subject": (_SUBJECTS + _MORE_SUBJECTS, (
        "What are the pros and cons of {x}?", "Summarize what everyone should know about {x} in three bullet points.",
        "What has changed about {x} in the last hundred years?", "Write a short paragraph about {x} for a school newsletter.",
    )),
    "home": (_HOME, ("How do I {x}?", "What is the easiest way to {x}?", "Give me step-by-step instructions to {x}.")),
    "tech": (_TECH, ("How do I {x}?", "Explain simply how to {x}.", "What should I know before I {x}?")),
    "explain": (tuple((t, r) for t in _TOPICS_TO_EXPLAIN for r in _READERS), ("Explain {x[0]} to {x[1]}.",)),
    "reword": (_REWORDINGS, (
        'Rewrite this sentence to sound friendlier: "{x}"', 'Make this sentence shorter: "{x}"',
        'Rewrite this in a formal tone: "{x}"', 'Translate into simple English for a child: "{x}"',
    )),
    "skill": (_SKILLS, ("Make me a one-week plan for {x}.", "What do experts wish beginners knew about {x}?",
                        "What equipment do I need for {x}?")),
    "city": (_CITIES + _COUNTRIES, ("What is the best time of year to visit {x}?", "What should I pack for a trip to {x}?",
                                     "Suggest a three-day itinerary for {x}.")),
    "job": (_JOBS, ("What is the hardest part of being a {x}?", "Write a short job advert for a {x}.")),
    "animal": (_ANIMALS, ("How do {x} communicate?", "How long do {x} live?", "Why are {x} important for nature?")),
    "food": (_FOODS, ("What can I serve with {x}?", "How do I make {x} healthier?")),
}


def _arithmetic(n: int) -> list[str]:
    """`n` small arithmetic and word problems, numbers from a fixed seed."""
    rng = random.Random(4)
    forms = (
        lambda a, b, c: f"What is {a} times {b}?",
        lambda a, b, c: f"What is {c}% of {a * 10}?",
        lambda a, b, c: f"Solve for x: {a}x + {b} = {a * c + b}.",
        lambda a, b, c: f"A train travels {a * c} km in {c} hours. What is its average speed?",
        lambda a, b, c: f"If I buy {c} notebooks at ${a} each and pay with ${a * c + b}, how much change do I get?",
        lambda a, b, c: f"What is {a * b} divided by {b}? Show the steps.",
        lambda a, b, c: f"A recipe needs {c} eggs for {b} people. How many eggs for {b * a} people?",
    )
    return [forms[i % len(forms)](rng.randint(2, 19), rng.randint(2, 12), rng.randint(2, 9)) for i in range(n)]


def _texts(requests: dict, seed: int, extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    texts = [template.format(x=slot) for slots, templates in requests.values()
             for slot in slots for template in templates] + list(extra)
    random.Random(seed).shuffle(texts)
    return list(dict.fromkeys(texts))  # one answer per text (the arithmetic may repeat itself)


def open_prompt_texts(excluded: frozenset[str] = frozenset()) -> list[str]:
    """Every request but `excluded`, in one fixed order: the first group shuffled (kinds interleaved, so
    any prefix is a mix), then the second group, shuffled apart, then the third."""
    ordered: dict[str, None] = {}  # a text already in an earlier group keeps its place there
    for requests, seed, extra in ((_REQUESTS, 2, ()), (_MORE_REQUESTS, 3, _arithmetic(280)), (_THIRD_REQUESTS, 5, ())):
        ordered.update((t, None) for t in _texts(requests, seed, extra) if t not in ordered)
    return [t for t in ordered if t not in excluded]

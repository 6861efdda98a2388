"""Training the bundled model pair and distilling drafts.

Files follow the pipeline: corpus.py (the stdlib corpus and its held-out split), tokenizer.py (BPE),
data.py (token caches, training windows), models.py (shapes and configs), objectives.py (what a
step optimises: joint target+draft, or draft-only distillation), loop.py (the one training loop:
schedule, checkpoints, resume), export.py (HF checkpoint directories), recipe.py (`duospec
train-tiny`), distill.py (`duospec distill`), answers.py (`duospec distill-data`: the target's
own answers to instruction prompts), acceptance.py (greedy acceptance and decode cost).
"""

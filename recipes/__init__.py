"""The shipped recipes, one module per algorithm. `recipe` loads them by file path (`cli/recipes.py`), the way it
loads a user's copy made with `recipe cp`, and torchrun starts them as scripts."""

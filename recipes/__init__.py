"""The shipped recipes, one module per algorithm. `recipe` imports them as `llm_recipe.recipes.<name>`
(`cli/recipes.py`; a user's copy made with `recipe cp` runs from its path), and torchrun starts them as scripts."""

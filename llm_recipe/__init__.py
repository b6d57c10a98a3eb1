"""`llm_recipe` for a checkout used in place: PYTHONPATH=<checkout>, or `python -m llm_recipe.cli.main` from it.

The repository keeps plain top-level folders (cli/, components/, configs/, recipes/). An install (wheel or editable)
maps them onto `llm_recipe.*` through pyproject.toml and does not ship this file. A checkout on sys.path finds this
package first, and its search path is the checkout itself, so `llm_recipe.cli` is cli/ here as well: what runs is
the checkout's code, whatever else the environment has installed.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parent.parent)]

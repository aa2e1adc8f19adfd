"""Multi-stage recipes: `runner` runs the stages of `recipe.stages` in order."""

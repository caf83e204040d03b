"""Recipes: commands that compose engine, drafter and tasks (the CLI runs them)."""

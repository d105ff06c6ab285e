"""ACME's Miles plugin: the ``mistral`` model bridge and the ``concise`` reward."""

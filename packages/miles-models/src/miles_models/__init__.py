"""Model provisioning for Miles: fetch known models, convert them once, resolve names to folders."""

from miles_models.cache import list_cached, miles_home
from miles_models.pull import ModelNotFoundError, pull, resolve_model

__all__ = ["ModelNotFoundError", "list_cached", "miles_home", "pull", "resolve_model"]

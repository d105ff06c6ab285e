"""Plugin ``openenv`` (distribution miles-openenv)."""

"""Router middlewares shipped with miles-router (registered in :mod:`miles_router.plugin`)."""

"""Trainer ranks as processes: the driver's group handle (:mod:`miles.trainer.group`), the rank
process (:mod:`miles.trainer.rank`) and the frames between them (:mod:`miles.trainer.wire`)."""

"""RL algorithms for Miles: advantage estimators, policy losses, KL, mismatch corrections, reductions.

Train backends call :mod:`miles_algorithms.objective`; implementations are registered by name in
:mod:`miles_algorithms.plugin`. torch is imported by the submodules, not here.
"""

"""Judging the measurements: detectors over StepRecords, anomaly episodes, the engine.

Every detector follows scikit-learn's outlier-detector contract (see `detectors.base`).
Imports only `collector` of ours.
"""

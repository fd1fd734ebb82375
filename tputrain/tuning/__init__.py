"""Hyperparameter tuning from one spec: `tputrain tune` (Optuna, locally) and
`tputrain vertex-spec --tune` (Vertex AI). spec.py reads the spec; report.py is the
trial's metric file (the cloudml-hypertune convention both engines read);
study.py runs a study locally. Optuna and pyyaml (the `tune` extra) are imported
only by a command that uses them."""

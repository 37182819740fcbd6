"""Pure machines and folds: no trio, no subprocess, no clock."""

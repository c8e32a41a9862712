"""The stage server: one peer process serving one stage's inference, training and spot-checks."""

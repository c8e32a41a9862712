"""The learner's maths: group-relative advantages and the per-token policy-gradient losses."""

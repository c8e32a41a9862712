"""Trust: identities and signatures, activation commitments, spot-check verification, reputation."""

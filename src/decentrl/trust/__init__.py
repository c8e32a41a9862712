"""Trust: identities and signatures, activation sketches, spot-check verification, reputation."""

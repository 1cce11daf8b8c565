"""The paper's quality instruments (§3): loss on the tokens that need the prefix, paired against exact."""

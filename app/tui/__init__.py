"""The terminal chat app (`duet chat`)."""

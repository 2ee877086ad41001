"""Small shared pieces with no dependency on the rest of the package."""

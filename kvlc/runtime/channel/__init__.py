"""The side channel: authenticated TCP frames, wire formats (never pickle), notifications, engine sessions."""

"""Media codecs and the worker processes they run in: image, audio and video decode and encode,
and the safe fetching of media sources."""

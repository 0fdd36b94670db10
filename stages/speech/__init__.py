"""The speech stages: asr (Whisper windows, decoding, transcripts) and tts, with their audio DSP."""

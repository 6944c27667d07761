"""The detokenizer/streamer: token ids -> UTF-8 safe text deltas with stop strings applied."""

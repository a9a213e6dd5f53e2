"""The guardrail offload (seed 000 §4.3): output classifiers that run on the CPU, off the device
budget, on a thread pool beside the engine, each check with a timeout.

classifier.py declares what a classifier is (text in, a score per label out); keras_bilstm.py
reads the toxic-comment-classifier package's Jigsaw BiLSTM without TensorFlow; hf_classifier.py
loads a Hugging Face sequence-classification folder; int8.py holds weights in 8 bits; loader.py
picks one from guardrail_path; pool.py runs checks with the timeout and counts them. The engine's
output gate (engine/output_gate.py) holds generated text until a check clears it.
"""

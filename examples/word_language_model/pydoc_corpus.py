"""A corpus that needs no download: the help topics of Python's documentation (pydoc_data, in the standard
library), about 65,000 words, as train.txt, valid.txt and test.txt (80/10/10 of its lines) in a folder."""
import os

from pydoc_data.topics import topics


def ensure(path, lines=None):
    """Write the three files into `path` unless they are there; `lines` keeps only the first so many."""
    if not os.path.exists(os.path.join(path, "train.txt")):
        text = [line for k in sorted(topics) for line in topics[k].splitlines() if line.strip()][:lines]
        cut = [0, len(text) * 8 // 10, len(text) * 9 // 10, len(text)]
        os.makedirs(path, exist_ok=True)
        for name, a, b in zip(("train", "valid", "test"), cut, cut[1:]):
            tmp = os.path.join(path, f".{name}.txt.{os.getpid()}")   # every rank writes the same: atomically
            with open(tmp, "w", encoding="utf8") as f:
                f.write("\n".join(text[a:b]) + "\n")
            os.replace(tmp, os.path.join(path, f"{name}.txt"))
    return path

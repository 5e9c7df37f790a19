"""`python -m ulfmtrain ...`"""
import sys

from .cli import main

sys.exit(main())

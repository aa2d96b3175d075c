"""The held-out items of ``hyla eval generate``: written for hyla, in no training corpus.

Three kinds, scored by what the model writes greedily:

- ``python``: a function's signature and docstring; the model writes the body, which must
  pass the item's asserts (pass@1, run by :mod:`hyla.eval.sandbox`);
- ``recall``: a short note with invented names, then a question on it; the answer must
  contain the reference (case-insensitive);
- ``qa``: arithmetic, common facts and following a format; the first line of the answer
  must contain one of the references (``case``: exactly as written).
"""

from __future__ import annotations

# (name, prompt: signature + docstring, tests run after the completed function)
PYTHON = [
    ("add", 'def add(a, b):\n    """Return the sum of a and b."""\n',
     "assert add(2, 3) == 5\nassert add(-4, 4) == 0\nassert add(1.5, 1) == 2.5"),
    ("is_even", 'def is_even(n):\n    """Return True if the integer n is even, else False."""\n',
     "assert is_even(4) is True\nassert is_even(7) is False\nassert is_even(0) is True"),
    ("reverse_string", 'def reverse_string(s):\n    """Return the string s reversed."""\n',
     "assert reverse_string('abc') == 'cba'\nassert reverse_string('') == ''"),
    ("count_vowels", 'def count_vowels(text):\n    """Return how many of the characters of '
     'text are vowels (a, e, i, o, u, either case)."""\n',
     "assert count_vowels('Hello World') == 3\nassert count_vowels('xyz') == 0\n"
     "assert count_vowels('AEIOU') == 5"),
    ("factorial", 'def factorial(n):\n    """Return n! for an integer n >= 0."""\n',
     "assert factorial(0) == 1\nassert factorial(5) == 120\nassert factorial(10) == 3628800"),
    ("largest", 'def largest(numbers):\n    """Return the largest number in the non-empty '
     'list numbers."""\n',
     "assert largest([3, 9, 2]) == 9\nassert largest([-5, -2, -9]) == -2\n"
     "assert largest([7]) == 7"),
    ("fizzbuzz", 'def fizzbuzz(n):\n    """Return "FizzBuzz" if n is divisible by 15, "Fizz" '
     'if by 3, "Buzz" if by 5, else str(n)."""\n',
     "assert fizzbuzz(15) == 'FizzBuzz'\nassert fizzbuzz(9) == 'Fizz'\n"
     "assert fizzbuzz(10) == 'Buzz'\nassert fizzbuzz(7) == '7'"),
    ("is_palindrome", 'def is_palindrome(s):\n    """Return True if the string s reads the '
     'same forwards and backwards."""\n',
     "assert is_palindrome('racecar')\nassert not is_palindrome('python')\n"
     "assert is_palindrome('')"),
    ("sum_of_squares", 'def sum_of_squares(n):\n    """Return 1*1 + 2*2 + ... + n*n."""\n',
     "assert sum_of_squares(1) == 1\nassert sum_of_squares(3) == 14\n"
     "assert sum_of_squares(0) == 0"),
    ("to_fahrenheit", 'def to_fahrenheit(celsius):\n    """Convert a temperature in degrees '
     'Celsius to degrees Fahrenheit."""\n',
     "assert to_fahrenheit(0) == 32\nassert to_fahrenheit(100) == 212\n"
     "assert abs(to_fahrenheit(37) - 98.6) < 1e-9"),
    ("unique_sorted", 'def unique_sorted(items):\n    """Return the distinct elements of the '
     'list items in ascending order."""\n',
     "assert unique_sorted([3, 1, 3, 2, 1]) == [1, 2, 3]\nassert unique_sorted([]) == []"),
    ("word_count", 'def word_count(text):\n    """Return the number of words in text, words '
     'being separated by whitespace."""\n',
     "assert word_count('the quick brown fox') == 4\nassert word_count('') == 0\n"
     "assert word_count('  spaced   out  ') == 2"),
]

# (name, note, question, references)
RECALL = [
    ("parcel", "The parcel for Mrs. Hallow was left at the blue gate on Tern Street.",
     "Where was the parcel left?", ["blue gate"]),
    ("keeper", "The lighthouse on Skerrow Point is kept by a man called Orlan Vesk.",
     "Who keeps the lighthouse?", ["Orlan"]),
    ("train", "The night train to Belmarsh leaves from platform nine at a quarter past ten.",
     "Which platform does the night train leave from?", ["nine", "9"]),
    ("cat", "Tilda's cat is named Pepperpot and sleeps on the piano every afternoon.",
     "What is the name of Tilda's cat?", ["Pepperpot"]),
    ("recipe", "Grandma Ivet's soup needs three leeks, a turnip and a spoon of honey.",
     "How many leeks does the soup need?", ["three", "3"]),
    ("meeting", "The harbour committee moved its meeting from Monday to Thursday.",
     "On which day is the meeting now?", ["Thursday"]),
    ("colour", "Every door in the village of Anwick is painted a deep green.",
     "What colour are the doors in Anwick?", ["green"]),
    ("code", "The code for the storeroom lock is 4172; only Marek and Jun know it.",
     "What is the code for the storeroom lock?", ["4172"]),
]

# (name, question, references, case-sensitive)
QA = [
    ("plus", "What is 15 plus 27?", ["42"], False),
    ("times", "What is 9 times 6?", ["54"], False),
    ("minus", "What is 100 minus 35?", ["65"], False),
    ("half", "What is half of 50?", ["25"], False),
    ("capital_france", "What is the capital of France?", ["Paris"], False),
    ("capital_japan", "What is the capital of Japan?", ["Tokyo"], False),
    ("week", "How many days are there in a week?", ["7", "seven"], False),
    ("freezing", "At how many degrees Celsius does water freeze?", ["0", "zero"], False),
    ("opposite", "What is the opposite of hot?", ["cold"], False),
    ("upper", "Write the word apple in capital letters.", ["APPLE"], True),
    ("plural", "What is the plural of mouse?", ["mice"], False),
    ("after_tuesday", "Which day comes after Tuesday?", ["Wednesday"], False),
]

# worked examples before every recall and qa question, so a base model answers on one line
QA_SHOTS = "Q: What is 2 plus 2?\nA: 4\n\nQ: What colour is the sky on a clear day?\nA: Blue\n\n"
RECALL_SHOTS = ("Note: Ada keeps her bicycle in the shed behind the bakery.\n"
                "Q: Where does Ada keep her bicycle?\nA: In the shed behind the bakery.\n\n")

# what a model with a chat template is asked (teacher and student alike)
CODE_ASK = ("Complete this Python function. Reply with the whole function in a ```python "
            "code block.\n\n```python\n{code}```")
BRIEF = "Answer in a few words."

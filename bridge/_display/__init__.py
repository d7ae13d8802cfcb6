"""How bridge's objects look: a Tree, a port plan, a load or port report and a
comparison, one screen in a terminal (`str`), HTML in Jupyter (`_repr_html_`) and
treescope (`__treescope_repr__`), from one outline each (`_outline.Line`).

The classes delegate to these modules in one line; the modules read only their
public fields, and never an array's values (shapes and dtypes only: a lazy or
abstract leaf stays unread).
"""

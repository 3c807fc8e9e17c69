"""The scheduler's waiting queue: resumed requests first, then new ones taken in turn across groups.

A group is the API request a sequence came from (its prompts x n samples), so one request's fan-out cannot
keep another's single sequence waiting behind it: admission takes the head of the first group, then moves
that group to the back of the rotation. Within a group, order is arrival order. Requests put back at the
front (preempted, or rolled back after a failed step) go before every group, most recent first.

Every operation is O(1) except iteration, so aborting any number of waiting requests costs time linear in
how many are aborted, whatever the queue's length.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvserve.core.request import Request


class RequestQueue:
    def __init__(self):
        self._front: OrderedDict[str, Request] = OrderedDict()  # first entry goes first
        # group -> its requests in arrival order; the dict's order is the rotation order.
        self._groups: OrderedDict[str, OrderedDict[str, Request]] = OrderedDict()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def append(self, req: Request) -> None:
        """A new request, behind the others of its group."""
        self._groups.setdefault(req.fairness_group, OrderedDict())[req.request_id] = req
        self._len += 1

    def appendleft(self, req: Request) -> None:
        """A request to resume before anything else."""
        self._front[req.request_id] = req
        self._front.move_to_end(req.request_id, last=False)
        self._len += 1

    def peek(self) -> Request:
        """What popleft() would return."""
        if self._front:
            return next(iter(self._front.values()))
        if not self._groups:
            raise IndexError("peek from an empty RequestQueue")
        return next(iter(next(iter(self._groups.values())).values()))

    def popleft(self) -> Request:
        if self._front:
            _, req = self._front.popitem(last=False)
        else:
            if not self._groups:
                raise IndexError("pop from an empty RequestQueue")
            group, members = next(iter(self._groups.items()))
            _, req = members.popitem(last=False)
            if members:
                self._groups.move_to_end(group)  # its next member waits for every other group's turn
            else:
                del self._groups[group]
        self._len -= 1
        return req

    def remove(self, req: Request) -> None:
        """Takes `req` out wherever it is; ValueError if it is not queued."""
        rid = req.request_id
        if self._front.get(rid) is req:
            del self._front[rid]
        else:
            members = self._groups.get(req.fairness_group)
            if members is None or members.get(rid) is not req:
                raise ValueError(f"request {rid!r} is not in the waiting queue")
            del members[rid]
            if not members:
                del self._groups[req.fairness_group]
        self._len -= 1

    def __contains__(self, req: object) -> bool:
        if not isinstance(req, Request):
            return False
        rid = req.request_id
        if self._front.get(rid) is req:
            return True
        members = self._groups.get(req.fairness_group)
        return members is not None and members.get(rid) is req

    def __iter__(self) -> Iterator[Request]:
        """In the order popleft() would return them (O(n))."""
        yield from self._front.values()
        turns = [iter(members.values()) for members in self._groups.values()]
        while turns:
            still = []
            for it in turns:
                req = next(it, None)
                if req is not None:
                    yield req
                    still.append(it)
            turns = still

    def __getitem__(self, index: int) -> Request:
        if index == 0:
            return self.peek()
        return list(self)[index]

//! KV pages for the serving scheduler, and the prefix cache over them.
//!
//! **Pages.** KV memory is budgeted in fixed-size pages (`page_size` positions) out of one
//! pool; a sequence's block table is the `Vec` of page ids that holds its positions in order.
//!
//! **Prefix cache** (vLLM's automatic prefix caching, full pages only). A page whose
//! `page_size` positions all hold computed keys and values can be *registered*: it is
//! indexed by its tokens and by the registration of the page before it in its sequence
//! (its parent; the first page's parent is the root). A page so indexed holds the keys and
//! values of exactly one token prefix: the chain of (parent, tokens) links from the root
//! spells the whole prefix out, and keys and values depend on nothing else (the model is
//! causal, positions are the page's place in the chain). A new sequence whose first tokens
//! spell a chain of registered pages takes those pages into its block table instead of
//! computing them: it shares them (read only: a sequence writes only positions past its
//! prompt's cached part, which lie in pages of its own) and its prefill starts after them.
//!
//! Registrations get ids from a counter and a link names its parent's id, never a page
//! number: when a registered page is evicted and its number reused, the links of its old
//! children name an id that no page carries any more, so they can never be matched again
//! (they are evicted in their turn). Nothing is ever matched by a hash alone: the index keys
//! are the tokens themselves.
//!
//! **Saved states** (hybrid models). A Qwen3.5 model's Gated DeltaNet layers carry a state
//! that no page holds: a sequence can take cached pages only up to a position whose state was
//! saved. With [`PagePool::with_states`] the pool also hands out numbered state snapshots: the
//! scheduler saves a sequence's state when its cached tokens end on a page boundary and
//! attaches the snapshot to the registered page that ends there; a lookup then takes pages
//! only up to the deepest one with a state, which the new sequence starts from. Snapshots are
//! fewer than pages: the least recently used one is reused first (its page stays cached, no
//! longer a place to resume), and a page evicted gives its snapshot back.
//!
//! **Eviction.** A page held by no sequence goes back to the free list, unless it is
//! registered: then it stays in the index as *idle* (its keys and values kept for the next
//! sequence with that prefix) and is evicted, least recently released first, only when the
//! free list is empty and a sequence needs a page. Idle pages count as available: the cache
//! never costs a request its admission.

use std::collections::{BTreeMap, HashMap};

/// A registration's id; [`ROOT`] is the parent of every sequence's first page.
pub type PrefixId = u64;

/// The parent of a sequence's first page.
pub const ROOT: PrefixId = 0;

/// A pool of fixed-size KV pages with an optional prefix cache (module doc).
#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    total: usize,
    /// Pages no sequence holds and no registration keeps; popped from the end.
    free: Vec<u32>,
    /// Per page: how many sequences hold it in their block tables.
    holders: Vec<u32>,
    cache: Option<PrefixCache>,
}

/// A registered page's index key: its parent's registration and its tokens.
type IndexKey = (PrefixId, Box<[u32]>);

/// The index of registered pages (module doc).
#[derive(Debug, Default)]
struct PrefixCache {
    /// (parent id, the page's tokens) → page.
    index: HashMap<IndexKey, u32>,
    /// Per page: its registration (id and index key) while it has one.
    entry: Vec<Option<(PrefixId, IndexKey)>>,
    /// Registered pages no sequence holds, by the tick of their release (oldest first).
    idle: BTreeMap<u64, u32>,
    /// Per page: its key in `idle` while it is idle.
    idle_at: Vec<Option<u64>>,
    tick: u64,
    next_id: PrefixId,
    /// Per page: the saved state after its last position, where one is kept.
    state_of: Vec<Option<u32>>,
    /// Saved states (`None`: pages only).
    states: Option<StateSnapshots>,
}

/// The numbered state snapshots of a hybrid model's prefix cache (module doc).
#[derive(Debug, Default)]
struct StateSnapshots {
    /// Per snapshot: the page it is attached to.
    page_of: Vec<Option<u32>>,
    /// Snapshots by the tick of their last use (saved or resumed from), oldest first.
    lru: BTreeMap<u64, u32>,
    used_at: Vec<Option<u64>>,
    free: Vec<u32>,
}

/// What [`PagePool::lookup`] found: the registered pages now at the start of the block table,
/// the registration to chain the sequence's next page from (and that registration's page),
/// and with saved states the snapshot to start from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixHit {
    pub pages: usize,
    pub parent: PrefixId,
    pub parent_page: Option<u32>,
    pub state: Option<u32>,
    /// Pages of the tokens the cache held (≥ `pages`): with saved states, where the matching
    /// chain ends past the last saved state. Its tokens are computed again, and a state saved
    /// where they end (a shared prefix's end) lets later sequences resume there.
    pub matched: usize,
}

impl PrefixHit {
    /// Nothing cached: the sequence starts from the root.
    pub const NONE: PrefixHit = PrefixHit {
        pages: 0,
        parent: ROOT,
        parent_page: None,
        state: None,
        matched: 0,
    };
}

impl PagePool {
    /// A pool of `total_pages` pages of `page_size` positions, without a prefix cache.
    pub fn new(total_pages: usize, page_size: usize) -> PagePool {
        assert!(page_size > 0, "page size must be positive");
        PagePool {
            page_size,
            total: total_pages,
            // Popped from the end: page 0 is handed out first.
            free: (0..total_pages as u32).rev().collect(),
            holders: vec![0; total_pages],
            cache: None,
        }
    }

    /// The same pool keeping registered pages for later sequences (module doc).
    pub fn with_prefix_cache(mut self) -> PagePool {
        self.cache = Some(PrefixCache {
            entry: vec![None; self.total],
            idle_at: vec![None; self.total],
            state_of: vec![None; self.total],
            next_id: ROOT + 1,
            ..PrefixCache::default()
        });
        self
    }

    /// A prefix cache of a hybrid model: `n` state snapshots (numbered `0..n`) besides the
    /// pages, and lookups that stop at the deepest page with a saved state (module doc).
    pub fn with_states(self, n: usize) -> PagePool {
        let mut p = if self.cache.is_some() {
            self
        } else {
            self.with_prefix_cache()
        };
        let c = p.cache.as_mut().expect("just made");
        c.states = Some(StateSnapshots {
            page_of: vec![None; n],
            used_at: vec![None; n],
            free: (0..n as u32).rev().collect(),
            ..StateSnapshots::default()
        });
        p
    }

    /// Whether lookups need saved states (a hybrid model's cache).
    pub fn saves_states(&self) -> bool {
        self.cache.as_ref().is_some_and(|c| c.states.is_some())
    }

    /// A snapshot to save the state after registered page `page` in, attached to it (the
    /// least recently used one when none is free, taken from its page); `None` where the
    /// page has one already, is not registered, or the pool keeps no states.
    pub fn state_slot_for(&mut self, page: u32) -> Option<u32> {
        let c = self.cache.as_mut()?;
        if c.state_of[page as usize].is_some() || c.entry[page as usize].is_none() {
            return None;
        }
        let st = c.states.as_mut()?;
        let snap = match st.free.pop() {
            Some(s) => s,
            None => {
                let (_, s) = st.lru.pop_first()?;
                st.used_at[s as usize] = None;
                if let Some(old) = st.page_of[s as usize].take() {
                    c.state_of[old as usize] = None;
                }
                s
            }
        };
        c.attach(snap, page);
        Some(snap)
    }

    /// Moves the snapshot attached to page `from` to registered page `to` (a sequence's
    /// rolling state, saved again further on): returns it, or `None` (nothing moved) where
    /// `from` has none any more (reused meanwhile), `to` has one or is not registered.
    pub fn move_state(&mut self, from: u32, to: u32) -> Option<u32> {
        let c = self.cache.as_mut()?;
        if c.state_of[to as usize].is_some() || c.entry[to as usize].is_none() {
            return None;
        }
        let snap = c.state_of[from as usize].take()?;
        c.attach(snap, to);
        Some(snap)
    }

    /// Drops the saved state attached to `page` (one that could not be written).
    pub fn forget_state(&mut self, page: u32) {
        if let Some(c) = self.cache.as_mut() {
            c.drop_state(page);
        }
    }

    pub fn caches_prefixes(&self) -> bool {
        self.cache.is_some()
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// Pages held by sequences.
    pub fn used(&self) -> usize {
        self.total - self.available()
    }

    /// Pages a sequence can take: the free ones and the idle registered ones (evicted first).
    pub fn available(&self) -> usize {
        self.free.len() + self.cached_idle()
    }

    /// Registered pages no sequence holds (kept for later sequences, evictable).
    pub fn cached_idle(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.idle.len())
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    /// Grows `table` to hold `tokens` tokens; all or nothing (`false`: not enough pages,
    /// `table` unchanged). Free pages first, then the least recently released idle ones
    /// (their registrations dropped).
    pub fn grow(&mut self, table: &mut Vec<u32>, tokens: usize) -> bool {
        let need = self.pages_for(tokens).saturating_sub(table.len());
        if need > self.available() {
            return false;
        }
        for _ in 0..need {
            let p = match self.free.pop() {
                Some(p) => p,
                None => self
                    .cache
                    .as_mut()
                    .and_then(PrefixCache::evict_oldest)
                    .expect("available pages cover the need"),
            };
            self.holders[p as usize] = 1;
            table.push(p);
        }
        true
    }

    /// Gives back every page of `table`: a page no other sequence holds becomes free, or idle
    /// if it is registered.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for p in table.drain(..) {
            let h = &mut self.holders[p as usize];
            debug_assert!(*h > 0, "page {p} released but not held");
            *h = h.saturating_sub(1);
            if *h > 0 {
                continue;
            }
            match &mut self.cache {
                Some(c) if c.entry[p as usize].is_some() => c.park(p),
                _ => self.free.push(p),
            }
        }
    }

    /// Takes into `table` (which must be empty) the registered pages that spell the first
    /// whole pages of `tokens`, in order, as far as they go. Without a prefix cache: none.
    pub fn lookup(&mut self, table: &mut Vec<u32>, tokens: &[u32]) -> PrefixHit {
        debug_assert!(
            table.is_empty(),
            "lookup into a block table that holds pages"
        );
        let Some(c) = &mut self.cache else {
            return PrefixHit::NONE;
        };
        let mut hit = PrefixHit::NONE;
        // With saved states: the deepest hit so far that has one.
        let mut resume = PrefixHit::NONE;
        for page_tokens in tokens.chunks_exact(self.page_size) {
            let key = (hit.parent, Box::<[u32]>::from(page_tokens));
            let Some(&p) = c.index.get(&key) else {
                break;
            };
            if let Some(t) = c.idle_at[p as usize].take() {
                c.idle.remove(&t);
            }
            self.holders[p as usize] += 1;
            table.push(p);
            hit.pages += 1;
            hit.matched = hit.pages;
            hit.parent = c.entry[p as usize]
                .as_ref()
                .expect("indexed pages are registered")
                .0;
            hit.parent_page = Some(p);
            if let Some(s) = c.state_of[p as usize] {
                resume = PrefixHit {
                    state: Some(s),
                    ..hit
                };
            }
        }
        if c.states.is_none() {
            return hit;
        }
        // A hybrid model resumes only where a state was saved: the snapshot is used now, and
        // the pages past it go back.
        if let Some(s) = resume.state {
            c.touch(s);
        }
        let mut past = table.split_off(resume.pages);
        self.release(&mut past);
        PrefixHit {
            matched: hit.pages,
            ..resume
        }
    }

    /// Registers `page` (held, its positions all computed) as the page after `parent` holding
    /// `tokens`; returns the registration to chain the sequence's next page from and its
    /// page: the page's own, or those of a page registered earlier with the same parent and
    /// tokens (this one then stays unregistered: it is freed as any page when released).
    /// Without a prefix cache: [`ROOT`] and the page, registering nothing.
    pub fn register(&mut self, page: u32, parent: PrefixId, tokens: &[u32]) -> (PrefixId, u32) {
        debug_assert_eq!(tokens.len(), self.page_size);
        debug_assert!(
            self.holders[page as usize] > 0,
            "registering a page nobody holds"
        );
        let Some(c) = &mut self.cache else {
            return (ROOT, page);
        };
        let key = (parent, Box::<[u32]>::from(tokens));
        if let Some(&p) = c.index.get(&key) {
            let id = c.entry[p as usize]
                .as_ref()
                .expect("indexed pages are registered")
                .0;
            return (id, p);
        }
        if let Some((id, _)) = &c.entry[page as usize] {
            // Registered before under another key (cannot happen for a page written once).
            return (*id, page);
        }
        let id = c.next_id;
        c.next_id += 1;
        c.index.insert(key.clone(), page);
        c.entry[page as usize] = Some((id, key));
        (id, page)
    }
}

impl PrefixCache {
    /// Parks a registered page no sequence holds any more as the newest idle one.
    fn park(&mut self, p: u32) {
        self.tick += 1;
        self.idle.insert(self.tick, p);
        self.idle_at[p as usize] = Some(self.tick);
    }

    /// Drops the registration of the least recently released idle page and returns it.
    fn evict_oldest(&mut self) -> Option<u32> {
        let (_, p) = self.idle.pop_first()?;
        self.idle_at[p as usize] = None;
        if let Some((_, key)) = self.entry[p as usize].take() {
            self.index.remove(&key);
        }
        // Its saved state, if any, goes back too.
        self.drop_state(p);
        Some(p)
    }

    /// Marks snapshot `s` used now (the newest in the reuse order).
    fn touch(&mut self, s: u32) {
        let Some(st) = self.states.as_mut() else {
            return;
        };
        self.tick += 1;
        if let Some(t) = st.used_at[s as usize].replace(self.tick) {
            st.lru.remove(&t);
        }
        st.lru.insert(self.tick, s);
    }

    /// Attaches snapshot `s` to `page` (which has none) and marks it used.
    fn attach(&mut self, s: u32, page: u32) {
        if let Some(st) = self.states.as_mut() {
            st.page_of[s as usize] = Some(page);
        }
        self.state_of[page as usize] = Some(s);
        self.touch(s);
    }

    /// Frees `page`'s snapshot, if it has one.
    fn drop_state(&mut self, page: u32) {
        if let (Some(s), Some(st)) = (self.state_of[page as usize].take(), self.states.as_mut()) {
            st.page_of[s as usize] = None;
            if let Some(t) = st.used_at[s as usize].take() {
                st.lru.remove(&t);
            }
            st.free.push(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_grow_all_or_nothing_and_release() {
        for cached in [false, true] {
            let mut pool = PagePool::new(4, 16);
            if cached {
                pool = pool.with_prefix_cache();
            }
            let (mut a, mut b) = (vec![], vec![]);
            assert!(pool.grow(&mut a, 1));
            assert_eq!(a.len(), 1);
            assert!(pool.grow(&mut a, 16), "16 tokens still fit one page");
            assert_eq!(a.len(), 1);
            assert!(pool.grow(&mut a, 17));
            assert_eq!(a.len(), 2);
            assert!(!pool.grow(&mut b, 3 * 16), "3 pages asked, 2 free");
            assert!(b.is_empty(), "a failed grow takes nothing");
            assert!(pool.grow(&mut b, 32));
            assert_eq!((pool.used(), pool.available()), (4, 0));
            let mut all: Vec<u32> = a.iter().chain(&b).copied().collect();
            all.sort();
            assert_eq!(all, vec![0, 1, 2, 3], "every page handed out once");
            pool.release(&mut a);
            assert!(a.is_empty());
            assert_eq!(pool.used(), 2);
            assert!(pool.grow(&mut b, 64));
            assert_eq!(pool.used(), 4);
        }
    }

    #[test]
    fn pages_for_rounds_up() {
        let pool = PagePool::new(8, 16);
        assert_eq!(pool.pages_for(0), 0);
        assert_eq!(pool.pages_for(1), 1);
        assert_eq!(pool.pages_for(16), 1);
        assert_eq!(pool.pages_for(17), 2);
    }

    /// Tokens `0..n` shifted by `base`: distinct page contents per base.
    fn toks(base: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| base + i).collect()
    }

    /// Registers every page of `table` in order for `tokens`; returns the last id.
    fn register_all(pool: &mut PagePool, table: &[u32], tokens: &[u32]) -> PrefixId {
        let mut parent = ROOT;
        for (p, t) in table.iter().zip(tokens.chunks_exact(pool.page_size())) {
            parent = pool.register(*p, parent, t).0;
        }
        parent
    }

    #[test]
    fn a_registered_prefix_is_shared_then_kept_idle() {
        let mut pool = PagePool::new(8, 4).with_prefix_cache();
        let t = toks(100, 12);
        let mut a = vec![];
        assert_eq!(pool.lookup(&mut a, &t), PrefixHit::NONE);
        assert!(pool.grow(&mut a, 12));
        let last = register_all(&mut pool, &a, &t);
        // Another sequence with the same first 8 tokens and a different third page.
        let mut u = t[..8].to_vec();
        u.extend(toks(900, 4));
        let mut b = vec![];
        let hit = pool.lookup(&mut b, &u);
        assert_eq!(hit.pages, 2);
        assert_eq!(b, a[..2], "the same pages, shared");
        assert_eq!(pool.used(), 3, "shared pages count once");
        // The whole of t: three pages, chained to the last registration.
        let mut c = vec![];
        let hit = pool.lookup(&mut c, &t);
        assert_eq!(
            (hit.pages, hit.parent, hit.parent_page),
            (3, last, Some(a[2]))
        );
        pool.release(&mut c);
        pool.release(&mut b);
        assert_eq!(pool.used(), 3, "a still holds its pages");
        pool.release(&mut a);
        assert_eq!(
            (pool.used(), pool.cached_idle(), pool.available()),
            (0, 3, 8)
        );
        // Idle pages are found again.
        let mut d = vec![];
        assert_eq!(pool.lookup(&mut d, &t).pages, 3);
        assert_eq!(pool.cached_idle(), 0);
        pool.release(&mut d);
        // A different first page breaks the chain at once.
        let mut e = vec![];
        assert_eq!(pool.lookup(&mut e, &toks(7, 12)), PrefixHit::NONE);
        // Same tokens as the second page but under the root: not the same prefix.
        assert_eq!(pool.lookup(&mut e, &t[4..8]), PrefixHit::NONE);
    }

    #[test]
    fn idle_pages_are_evicted_oldest_first_and_their_children_orphaned() {
        let mut pool = PagePool::new(4, 2).with_prefix_cache();
        let (ta, tb) = (toks(10, 4), toks(20, 4));
        let (mut a, mut b) = (vec![], vec![]);
        assert!(pool.grow(&mut a, 4));
        register_all(&mut pool, &a, &ta);
        assert!(pool.grow(&mut b, 4));
        register_all(&mut pool, &b, &tb);
        pool.release(&mut a); // a's pages are the oldest idle ones
        pool.release(&mut b);
        assert_eq!((pool.available(), pool.cached_idle()), (4, 4));
        // One page needed: a's first page (released first) goes.
        let mut c = vec![];
        assert!(pool.grow(&mut c, 1));
        assert_eq!(pool.cached_idle(), 3);
        let mut x = vec![];
        assert_eq!(
            pool.lookup(&mut x, &ta),
            PrefixHit::NONE,
            "its root page is gone"
        );
        // Its child is still indexed under the dead parent id, so it is never matched again,
        // even when the evicted page number is registered anew with the same tokens.
        let reused = c[0];
        let (id, _) = pool.register(reused, ROOT, &ta[..2]);
        let mut y = vec![];
        let hit = pool.lookup(&mut y, &ta);
        assert_eq!(
            (hit.pages, hit.parent),
            (1, id),
            "only the new registration"
        );
        assert_eq!(y, vec![reused]);
        pool.release(&mut y);
        assert_eq!(
            pool.lookup(&mut x, &tb).pages,
            2,
            "b's pages were not evicted"
        );
    }

    #[test]
    fn a_duplicate_registration_chains_to_the_first() {
        let mut pool = PagePool::new(4, 2).with_prefix_cache();
        let t = toks(5, 4);
        let (mut a, mut b) = (vec![], vec![]);
        assert!(pool.grow(&mut a, 4));
        assert!(pool.grow(&mut b, 4));
        let ia = register_all(&mut pool, &a, &t);
        // b computed the same prefix in its own pages (both admitted before either registered).
        let ib = register_all(&mut pool, &b, &t);
        assert_eq!(ia, ib, "b's chain continues from a's registrations");
        pool.release(&mut b);
        assert_eq!(
            (pool.cached_idle(), pool.available()),
            (0, 2),
            "b's unregistered pages are simply free"
        );
        pool.release(&mut a);
        assert_eq!(pool.cached_idle(), 2);
    }

    #[test]
    fn without_a_cache_nothing_is_kept() {
        let mut pool = PagePool::new(4, 2);
        let t = toks(5, 4);
        let mut a = vec![];
        assert!(pool.grow(&mut a, 4));
        assert_eq!(register_all(&mut pool, &a, &t), ROOT);
        pool.release(&mut a);
        assert_eq!((pool.cached_idle(), pool.available()), (0, 4));
        assert_eq!(pool.lookup(&mut a, &t), PrefixHit::NONE);
    }

    #[test]
    fn hybrid_lookups_stop_at_the_deepest_saved_state() {
        let mut pool = PagePool::new(8, 2).with_states(2);
        assert!(pool.saves_states());
        let t = toks(40, 8);
        let mut a = vec![];
        assert!(pool.grow(&mut a, 8));
        register_all(&mut pool, &a, &t);
        // Pages registered but no state saved: nothing to resume from (the four pages that
        // matched are named, for a state to be saved where they end).
        let mut b = vec![];
        assert_eq!(
            pool.lookup(&mut b, &t),
            PrefixHit {
                matched: 4,
                ..PrefixHit::NONE
            }
        );
        assert!(b.is_empty(), "the pages taken went back");
        assert_eq!(pool.used(), 4);
        // States after pages 1 and 2 (tokens 0..4 and 0..6).
        let s1 = pool.state_slot_for(a[1]).unwrap();
        let s2 = pool.state_slot_for(a[2]).unwrap();
        assert_eq!(pool.state_slot_for(a[2]), None, "already saved");
        let hit = pool.lookup(&mut b, &t);
        assert_eq!((hit.pages, hit.state, b.len()), (3, Some(s2), 3));
        assert_eq!(hit.matched, 4, "page 3 matched too, past the last state");
        pool.release(&mut b);
        // A prompt that stops inside page 2: resume after page 1.
        let hit = pool.lookup(&mut b, &t[..5]);
        assert_eq!((hit.pages, hit.state), (2, Some(s1)));
        pool.release(&mut b);
        // A third state takes the least recently used snapshot (s2's: s1 was used last).
        let s3 = pool.state_slot_for(a[3]).unwrap();
        assert_eq!(s3, s2);
        let hit = pool.lookup(&mut b, &t);
        assert_eq!((hit.pages, hit.state), (4, Some(s3)));
        pool.release(&mut b);
        let hit = pool.lookup(&mut b, &t[..6]);
        assert_eq!(
            (hit.pages, hit.state),
            (2, Some(s1)),
            "page 2's state was taken"
        );
        pool.release(&mut b);
        // Evicting pages frees their snapshots.
        pool.release(&mut a);
        let mut c = vec![];
        assert!(
            pool.grow(&mut c, 16),
            "all eight pages, the idle ones evicted"
        );
        let fresh = pool.register(c[0], ROOT, &[1, 2]).1;
        assert!(pool.state_slot_for(fresh).is_some());
        assert!(
            pool.state_slot_for(c[1]).is_none(),
            "an unregistered page takes none"
        );
        pool.release(&mut c);
        let mut d = vec![];
        assert_eq!(pool.lookup(&mut d, &[1, 2, 3]).pages, 1);
        // A rolling state moves on: its old page no longer resumes anything.
        let next = pool.register(d[0], ROOT, &[1, 2]).1;
        assert_eq!(next, fresh, "the same prefix registers as the same page");
        pool.release(&mut d);
        let mut e = vec![];
        assert!(pool.grow(&mut e, 2));
        let (id, _) = pool.register(e[0], ROOT, &[9, 9]);
        let moved = pool.move_state(fresh, e[0]).expect("moved");
        assert_eq!(pool.move_state(fresh, e[0]), None, "nothing left to move");
        let mut f = vec![];
        let hit = pool.lookup(&mut f, &[1, 2, 3]);
        assert_eq!((hit.pages, hit.state, hit.matched), (0, None, 1));
        let hit = pool.lookup(&mut f, &[9, 9, 1]);
        assert_eq!((hit.pages, hit.parent, hit.state), (1, id, Some(moved)));
    }
}

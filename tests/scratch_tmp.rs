mod common;
use headwise::model::*;
use std::time::Instant;
#[test]
fn scratch() {
    let p = common::real_model();
    let lm = LoadedModel::load(&p, Numerics::Fast).unwrap();
    let m = &lm.model;
    for ctx in [8usize] {
        let ids: Vec<u32> = (0..ctx as u32).map(|i| 300 + (i * 7) % 5000).collect();
        let mut c = KvCache::new(m.config(), ctx + 64);
        let t = Instant::now();
        m.forward(&ids, &mut c, Logits::Last, &mut NoObserver, &Interventions::new()).unwrap();
        let pre = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for i in 0..400u32 { m.forward(&[400 + i], &mut c, Logits::Last, &mut NoObserver, &Interventions::new()).unwrap(); }
        let dec = t.elapsed().as_secs_f64() / 400.0;
        eprintln!("ctx {ctx}: prefill {:.1} tok/s, decode {:.2} ms/tok = {:.1} tok/s", ctx as f64 / pre, dec * 1e3, 1.0 / dec);
    }
}

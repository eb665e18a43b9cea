use headwise::model::*;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let numerics: Numerics = args[2].parse().unwrap();
    let model = Model::load(std::path::Path::new(&args[1]), numerics).unwrap();
    let ids: Vec<u32> = args[3].split(',').map(|s| s.parse().unwrap()).collect();
    let forced: Vec<u32> = args[4].split(',').map(|s| s.parse().unwrap()).collect();
    let mut cache = KvCache::new(model.config(), 64);
    let mut logits = model
        .forward(
            &ids,
            &mut cache,
            Logits::Last,
            &mut NoObserver,
            &Interventions::new(),
        )
        .unwrap();
    for &t in &forced {
        let v: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
        let m = v.iter().cloned().fold(f32::MIN, f32::max);
        let lse = m + v.iter().map(|x| (x - m).exp()).sum::<f32>().ln();
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap());
        println!(
            "{:?}",
            idx[..5]
                .iter()
                .map(|&i| (i, ((v[i] - lse) * 1000.0).round() / 1000.0))
                .collect::<Vec<_>>()
        );
        logits = model
            .forward(
                &[t],
                &mut cache,
                Logits::Last,
                &mut NoObserver,
                &Interventions::new(),
            )
            .unwrap();
    }
}
